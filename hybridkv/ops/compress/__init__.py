"""The compressor's pooling and entry finishing. `compress_entries` returns finished entries
(pool → RMSNorm → RoPE → storage round trip); `compress_paged` also writes them into a paged pool,
packed or as float values. One fused Triton kernel on CUDA, the plain-torch reference elsewhere."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.compress.reference import (  # noqa: F401
    block_rows, each_block_rows, finish_entries, pool_blocks, softmax_pool)
from hybridkv.ops.kv_formats import index_block_views, pack_index_fp4, pack_main_fp8
from hybridkv.ops.paged import PagedBatch, entry_rows


def _kernel_ok(x: torch.Tensor, d: int, rope: int, kind: str, pow2: bool, packed: bool = False) -> bool:
    """Whether the Triton kernels finish these entries: power-of-two widths, and for main entries
    with plain FP8 scales (pow2 False) a float store (a packed entry holds ue8m0 scale bytes)."""
    if not use_triton(x) or d & (d - 1) or (not pow2 and packed and kind == "main"):
        return False
    return d % 32 == 0 if kind == "index" else (rope % 64 == 0 and d >= 64)


def compress_entries(kv_rows: torch.Tensor, score_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                     freqs: torch.Tensor, kind: str, out_dtype: torch.dtype, pow2: bool = True) -> torch.Tensor:
    """kv_rows/score_rows [n, L, d] (L rows pooled per entry, see `block_rows`), freqs [n, rope/2] complex
    -> entries [n, d] of out_dtype, on the storage grid ("main": FP8 nope; "index": Hadamard + FP4)."""
    n, _, d = kv_rows.shape
    if n and _kernel_ok(kv_rows, d, 2 * freqs.shape[-1], kind, pow2):
        from hybridkv.ops.compress import triton as kernels
        out = torch.empty(n, d, dtype=out_dtype, device=kv_rows.device)
        kernels.compress_write(kv_rows, score_rows, norm_weight, eps, freqs.real, freqs.imag, kind, out, False,
                               torch.arange(n, dtype=torch.int32, device=kv_rows.device),
                               out_bf16=out_dtype == torch.bfloat16, pow2=pow2)
        return out
    return finish_entries(softmax_pool(kv_rows.float(), score_rows.float()), norm_weight, eps, freqs, kind, out_dtype,
                          pow2=pow2)


def compress_paged(kv_rows: torch.Tensor, score_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   freqs: torch.Tensor, kind: str, pool: torch.Tensor, fmt: str, block_tables: torch.Tensor,
                   ent_req: torch.Tensor, ent_j: torch.Tensor, entries_per_block: int,
                   out_dtype: torch.dtype = torch.bfloat16) -> None:
    """Finish n entries and write entry ent_j[i] of request ent_req[i] into
    pool[block_tables[req, j // epb], j % epb]; an entry whose j is −1 is computed but not written
    (fixed-shape batches under CUDA graphs). fmt: "fp8" (main, 584-B), "fp4" (index, 68-B, in the block
    layout of kv_formats.py) or
    "bf16" (float values of the pool's dtype)."""
    n, _, d = kv_rows.shape
    if n == 0:
        return
    packed = fmt in ("fp8", "fp4")
    flat = pool.view(-1, pool.shape[-1])
    if _kernel_ok(kv_rows, d, 2 * freqs.shape[-1], kind, True):
        from hybridkv.ops.compress import triton as kernels
        kernels.compress_write(kv_rows, score_rows, norm_weight, eps, freqs.real, freqs.imag, kind, flat, packed,
                               ent_j.to(torch.int32), ent_req.to(torch.int32), block_tables, entries_per_block,
                               out_bf16=out_dtype == torch.bfloat16, block_layout=fmt == "fp4")
        return
    x = finish_entries(softmax_pool(kv_rows.float(), score_rows.float()), norm_weight, eps, freqs, kind, out_dtype)
    if fmt == "fp8":
        x = pack_main_fp8(x, 2 * freqs.shape[-1])
    elif fmt == "fp4":
        x = pack_index_fp4(x)
    view = PagedBatch(ent_req, ent_j, ent_req, block_tables, ent_req, ent_req)
    rows = entry_rows(view, ent_req.long(), ent_j.long(), entries_per_block)
    keep = rows >= 0
    if fmt == "fp4":        # packed keys: the block layout of kv_formats.py
        codes, scales = index_block_views(pool.view(-1, entries_per_block, pool.shape[-1]), d)
        r = rows[keep]
        codes[r // entries_per_block, r % entries_per_block] = x[keep, : d // 2]
        scales[r // entries_per_block, r % entries_per_block] = x[keep, d // 2:]
        return
    flat[rows[keep]] = x[keep].to(flat.dtype)


def compress_decode_ok(x: torch.Tensor, d: int, rope: int, kind: str, pow2: bool, fmt: str) -> bool:
    """Whether `compress_decode_paged` takes this compressor: the Triton kernels run, over packed
    pools ("fp8", "fp4") or float ones ("bf16": float values of the pool's dtype)."""
    return fmt in ("fp8", "fp4", "bf16") and _kernel_ok(x, d, rope, kind, pow2, packed=fmt != "bf16")


def compress_decode_paged(state_kv: torch.Tensor, state_score: torch.Tensor, slots: torch.Tensor,
                          positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool,
                          norm_weight: torch.Tensor, eps: float, rotation: tuple[torch.Tensor, torch.Tensor],
                          kind: str, pool: torch.Tensor, fmt: str, block_tables: torch.Tensor, entries_per_block: int,
                          out_dtype: torch.dtype = torch.bfloat16, ape: torch.Tensor | None = None,
                          save: tuple[torch.Tensor, torch.Tensor] | None = None, pow2: bool = True,
                          waves: int = 1) -> None:
    """A decode step's compressor work for B requests in one launch: each token's rows kv/score
    [B, width] go into its request's state (state_kv/state_score [slots, rows, width], in place);
    where the token ends a block (pos + 1 ≡ 0 mod ratio), the block is pooled, finished (`rotation`:
    cos and sin [B, rope/2] at each request's block start) and stored packed into `pool` as entry
    (pos + 1) / ratio − 1, and the state advances. `ape` [ratio, width]: the position bias not yet
    added to `score` (`Compressor.project(..., ape=False)`). `save`: (kv, score) [B, rows, width]
    float32 that receive each request's state as it was before the update (a speculative verify
    wave's copy, in the same launch). `waves` > 1: each request's tokens of that many consecutive
    positions (rows w·B + b of positions, kv, score and the rotation; a speculative step's verify
    waves) one after another in the same launch, `save` then [waves − 1, B, rows, width]: the states
    before waves 1... `fmt` "bf16": float entries (main ones with plain FP8 scales
    where `pow2` is False). The same state and the same pool bytes as `Compressor.update_decode` with
    `compress_paged` (packed) or the compressor's own finishing (float) as its writer (the tests
    compare them); CUDA (or the interpreter) only: see `compress_decode_ok`."""
    from hybridkv.ops.compress import triton as kernels
    flat = pool.view(-1, pool.shape[-1])
    kernels.compress_decode(state_kv, state_score, slots, positions, kv, score, ratio, overlap, norm_weight, eps,
                            *rotation, kind, flat, block_tables, entries_per_block,
                            out_bf16=out_dtype == torch.bfloat16, block_layout=fmt == "fp4", ape=ape, save=save,
                            packed=fmt != "bf16", pow2=pow2, waves=waves)


def compress_decode_latent(state_kv: torch.Tensor, state_score: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ratio: int,
                           norm_weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """V4.1's stateful compressor (no overlap, no position bias) for a decode group in one launch,
    where the Triton kernels run (None elsewhere): each token's rows go into its request's state
    (state_kv/state_score [slots, ratio, d], in place); returns (the normalised latent [B, d] of the
    block each token ends, zeros where it ends none; entry ids [B] int64, −1 where none), what
    `Compressor.update_decode` with a writer gives (see `triton.compress_decode_latent`)."""
    if not use_triton(kv):
        return None
    from hybridkv.ops.compress import triton as kernels
    return kernels.compress_decode_latent(state_kv, state_score, slots, positions, kv, score, ratio, norm_weight, eps,
                                          out_dtype)
