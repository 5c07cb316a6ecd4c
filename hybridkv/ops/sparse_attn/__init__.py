"""Sparse attention with a per-head sink: `sparse_attn` over contiguous rows and an index list,
`sparse_attn_paged` over the window ring, the chunk's new rows and a paged compressed pool
(layout in `hybridkv.ops.paged`). Triton kernels on CUDA, the plain-torch reference elsewhere."""

from __future__ import annotations

import dataclasses

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.sparse_attn import reference
from hybridkv.ops.sparse_attn.reference import gather_paged


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                like_tokens: int | None = None) -> torch.Tensor:
    """q [T, H, D], kv [N, D], idx [T, K] (int, −1 = none), sink [H] -> o [T, H, D] (float32).
    `like_tokens` as in `sparse_attn_paged`."""
    if use_triton(q):
        from hybridkv.ops.sparse_attn import triton as kernels
        return kernels.sparse_attn(q, kv, idx, sink, scale, like_tokens=like_tokens)
    return reference.sparse_attn(q, kv, idx, sink, scale)


def sparse_attn_paged(q: torch.Tensor, sink: torch.Tensor, scale: float, batch, new_kv: torch.Tensor,
                      ring: torch.Tensor | None, pool: torch.Tensor | None, idx: torch.Tensor | None = None,
                      ratio: int = 0, fmt: str = "bf16", head_dim: int | None = None, rope_dim: int = 0,
                      window: int = 128, max_pos: int | None = None,
                      tables: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                      out: torch.Tensor | None = None, like_tokens: int | None = None) -> torch.Tensor:
    """Attention of every token of a paged batch over its window and compressed rows.

    q [T, H, D]; new_kv [T, E] the chunk's own rows; ring [num_slots, window, E]; pool
    [num_blocks, entries_per_block, E] (None for window-only layers); idx [T, K] compressed entry ids
    (CSA, −1 = none) or None with `ratio` set (HCA: all visible entries). Entries are `fmt` "bf16"
    (float elements), "fp8" (584-B packed, needs head_dim/rope_dim) or "v41" (V4.1's packed rows:
    window rows in the ring and new rows, global KV entries in the pool; `hybridkv.ops.kv_formats`). `tables` [R, blocks]: where
    the pool holds each block's entries, when not at `batch.block_tables` (a memory policy's device
    pages). Returns [T, H, D] in `out_dtype` (float32 computed, rounded once when stored: a bf16
    model's prefill holds no float32 copy of its attention output). `out` [T, H, D] of out_dtype,
    contiguous: where the kernels write the result, and may be q itself (each program reads its
    token's query heads before it writes their output, and no other program reads them); the
    reference path returns a new tensor. Use the returned tensor. `like_tokens`: the kernels split
    each token's rows as in a launch of that many tokens (speculative verify rows, each computed as
    the plain decode row at its position: the split fixes the order of the float sums).
    """
    head_dim = head_dim or q.shape[-1]
    if tables is not None:
        batch = dataclasses.replace(batch, block_tables=tables)
    if use_triton(q):
        from hybridkv.ops.sparse_attn import triton as kernels
        return kernels.sparse_attn_paged(q, sink, scale, batch, new_kv, ring, pool, idx, ratio, fmt, head_dim,
                                         rope_dim, window, max_pos, out_dtype=out_dtype, out=out,
                                         like_tokens=like_tokens)
    rows, index = gather_paged(batch, new_kv, ring, pool, idx, ratio, fmt, head_dim, rope_dim, window)
    return reference.sparse_attn(q, rows, index, sink, scale).to(out_dtype)
