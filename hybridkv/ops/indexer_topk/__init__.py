"""Lightning Indexer scoring and causal top-k: `indexer_topk` over contiguous keys,
`indexer_topk_paged` over a paged key pool (layout in `hybridkv.ops.paged`). Triton kernels on
CUDA (exact radix select; indices in ascending entry order), the plain-torch reference elsewhere
(indices in score order). Both return −1 in unused slots."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.indexer_topk import reference
from hybridkv.ops.indexer_topk.reference import (  # noqa: F401
    candidate_blocks, causal_topk, index_scores, mask_invisible)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                 topk: int) -> torch.Tensor:
    """q [T, H, d], weights [T, H], keys [N, d], visible [T] -> [T, min(topk, N)] entry ids, −1 padded."""
    if use_triton(q):
        from hybridkv.ops.indexer_topk import triton as kernels
        return kernels.indexer_topk(q, weights, keys, visible, topk).long()
    return reference.topk_in_row_slices(q, weights, keys, visible, topk)


def paged_scores(q: torch.Tensor, weights: torch.Tensor, batch, pool: torch.Tensor, ratio: int = 4, fmt: str = "bf16",
                 head_dim: int | None = None, max_visible: int | None = None, fp4_queries: bool = False) -> torch.Tensor:
    """Indexer scores Σ_h w_h·relu(q_h·k) of one decode token per row of a paged batch over the
    compressed entries it sees: float32 [T, max_visible], −inf beyond a row's visible entries
    ((pos + 1) // ratio). For callers that select with rules of their own (V4.1's candidate pool);
    `indexer_topk_paged` selects in the kernels. `pool`/`fmt`/`fp4_queries` as there."""
    if use_triton(q):
        from hybridkv.ops.indexer_topk import triton as kernels
        return kernels.paged_scores(q, weights, batch, pool, ratio, fmt, head_dim, max_visible, fp4_queries)
    return reference.paged_scores(q, weights, batch, pool, ratio, fmt, head_dim, max_visible)


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, batch, pool: torch.Tensor, topk: int, ratio: int = 4,
                       fmt: str = "bf16", head_dim: int | None = None, max_visible: int | None = None,
                       resident: torch.Tensor | None = None, fp4_queries: bool = False,
                       per_token: bool = False) -> torch.Tensor:
    """Top-k compressed entries of each token of a paged batch among its visible ones (j < (pos+1)//ratio).

    pool [num_blocks, block_tokens // ratio, Ei]: "bf16" (float elements, Ei = head_dim) or "fp4"
    (68-B packed keys). Returns [T, topk] entry ids, −1 padded (int32 from the kernel, int64 from
    the reference). `max_visible` (an upper bound of the visible counts) avoids a host sync.
    `resident` [R, ≥ blocks] (a memory policy's device pages, −1 = on the host only): only entries of
    blocks with a page ≥ 0 are chosen; slots the resident entries do not fill are −1.
    `fp4_queries`: q lies on the FP4 grid (V4's and V4.1's indexer queries after their FP4 round
    trip), which lets FP4 keys be scored exactly on the integer tensor cores (`score_mma`).
    `per_token`: each token scored as a decode token is (one token's keys per program) whatever the
    batch, and without reading the device (speculative verify rows under a CUDA graph).
    """
    if use_triton(q):     # the kernels score and select over the resident blocks alone
        from hybridkv.ops.indexer_topk import triton as kernels
        return kernels.indexer_topk_paged(q, weights, batch, pool, topk, ratio, fmt, head_dim, max_visible, resident,
                                          fp4_queries, per_token)
    idx = reference.indexer_topk_paged(q, weights, batch, pool, topk, ratio, fmt, head_dim, resident)
    if resident is None:
        return idx
    # entries of host-only blocks score −inf: they fill the slots only when fewer resident entries exist
    per = batch.block_tokens // ratio
    page = resident.long()[batch.token_req.long().unsqueeze(1), idx.long().clamp(min=0) // per]
    return torch.where((idx >= 0) & (page >= 0), idx, -1).to(idx.dtype)
