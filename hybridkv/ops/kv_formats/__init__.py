"""Packed byte formats of KV entries (SPEC §2.2), as plain-torch pack/unpack references.

V4 main entry ("fp8", 584 B at head_dim 512 / rope 64), bytes in order:
    [nope e4m3: D−R][rope bf16: 2R][ue8m0 scale per 64 nope dims: (D−R)/64][zero pad to a multiple of 8]
V4 indexer key ("fp4", 68 B at 128):
    [E2M1 pairs, low nibble = even element: d/2][ue8m0 scale per 32: d/32]
In a paged pool of indexer keys, a block of E entries keeps the same bytes codes first: the E code
rows (d/2 bytes each), then the E scale rows (d/32 bytes each), so a key's codes are one aligned run
that kernels read with 16-byte loads (`index_block_views`, `index_rows_to_blocks`).
V4.1 ("v41"): global KV (288 B at 512) [E2M1 pairs: d/2][e4m3 scale per 16: d/16]; window row
(528 B at 512) [e4m3: d][ue8m0 scale per 32: d/32]; indexer keys as V4's.

Packing is exact for values the model already round-tripped (the nope dims through FP8 in blocks of
64 and the indexer keys through FP4 in blocks of 32, both with power-of-two scales; V4.1's window
through FP8 in blocks of 32, power-of-two; its global KV through FP4 in blocks of 16 with e4m3
scales): the scale of each block is re-derived from the block's largest value and every value is
representable. (V4.1's e4m3 scales are recovered from the block's values, see `pack_v41_global`.) The rope dims
are stored in bf16, as the reference keeps them.

On CUDA the packings a decode step runs (`pack_index_fp4`, `pack_v41_global`, `pack_v41_window`)
are one Triton launch each (`triton.py`), with the same bytes.
"""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.quant import (FP8_AMAX_FLOOR, FP4_AMAX_FLOOR, e2m1_magnitude, e2m1_round, pack_fp4, pow2_scale,
                                quant_fp4, unpack_fp4)

FP8_TILE = 64
FP4_TILE = 32


def main_entry_bytes(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    raw = nope + 2 * rope_dim + nope // FP8_TILE
    return -(-raw // 8) * 8


def index_entry_bytes(dim: int) -> int:
    return dim // 2 + dim // FP4_TILE


def _e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float8_e8m0fnu).view(torch.uint8)


def _from_e8m0(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float8_e8m0fnu).float()


def pack_main_fp8(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[N, D] entries (nope dims already on the FP8 power-of-two grid) -> uint8 [N, bytes]."""
    n, d = x.shape
    nope = d - rope_dim
    blocks = x[:, :nope].float().reshape(n, nope // FP8_TILE, FP8_TILE)
    scale = pow2_scale(blocks.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR), 448.0)
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, nope).view(torch.uint8)
    rope = x[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    out = torch.zeros(n, main_entry_bytes(d, rope_dim), dtype=torch.uint8, device=x.device)
    out[:, :nope] = q
    out[:, nope:nope + 2 * rope_dim] = rope
    out[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // FP8_TILE] = _e8m0_bytes(scale)
    return out


def unpack_main_fp8(buf: torch.Tensor, head_dim: int, rope_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    nope = head_dim - rope_dim
    q = buf[:, :nope].contiguous().view(torch.float8_e4m3fn).float().reshape(n, nope // FP8_TILE, FP8_TILE)
    scale = _from_e8m0(buf[:, nope + 2 * rope_dim:nope + 2 * rope_dim + nope // FP8_TILE])
    rope = buf[:, nope:nope + 2 * rope_dim].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scale.unsqueeze(-1)).reshape(n, nope), rope], dim=1).to(dtype)


def _kernel(x: torch.Tensor):
    """The Triton packings for x [N, d] (d a power of two holding at least one 32-value tile), or
    None where the plain-torch ones run."""
    if use_triton(x) and not x.shape[1] & (x.shape[1] - 1) and x.shape[1] >= 32:
        from hybridkv.ops.kv_formats import triton as kernels
        return kernels
    return None


def pack_index_fp4(x: torch.Tensor) -> torch.Tensor:
    """[N, d] indexer keys (already on the FP4 power-of-two grid, as the indexer's quantiser leaves
    them) -> uint8 [N, d/2 + d/32]. Not checked: it runs in every decode step, captured in CUDA
    graphs, and the check would read the device's answer on the host."""
    if (kernels := _kernel(x)) is not None:
        return kernels.pack_index_fp4(x, FP4_TILE)
    n, d = x.shape
    blocks = x.float().reshape(n, d // FP4_TILE, FP4_TILE)
    scale = pow2_scale(blocks.abs().amax(-1).clamp(min=FP4_AMAX_FLOOR), 6.0)
    codes = pack_fp4((blocks / scale.unsqueeze(-1)).reshape(n, d), check=False).view(torch.uint8)
    return torch.cat([codes, _e8m0_bytes(scale)], dim=1)


def pack_into_pool(rows: torch.Tensor, kind: str, pool: torch.Tensor, tables: torch.Tensor, which: torch.Tensor,
                   ids: torch.Tensor, block_layout: bool) -> bool:
    """Where the packing kernels run: pack rows [N, d] ("index": `pack_index_fp4`; "v41_global":
    `pack_v41_global`, unchecked) straight into a paged pool [blocks, E, width], row n as entry
    ids[n] of request which[n] through its block table `tables`, none where ids[n] is −1, and return
    True. False elsewhere: the caller packs and writes."""
    if (kernels := _kernel(rows)) is None:
        return False
    dest = kernels.PagedDest(pool, tables, which, ids, block_layout)
    if kind == "index":
        kernels.pack_index_fp4(rows, FP4_TILE, dest)
    elif kind == "v41_global":
        kernels.pack_v41_global(rows, V41_GLOBAL_TILE, dest)
    else:
        raise ValueError(f"no paged packing of {kind!r} entries")
    return True


def unpack_index_fp4(buf: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    vals = unpack_fp4(buf[:, : dim // 2].contiguous()).reshape(n, dim // FP4_TILE, FP4_TILE)
    scale = _from_e8m0(buf[:, dim // 2:])
    return (vals * scale.unsqueeze(-1)).reshape(n, dim).to(dtype)


def index_block_views(pool: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed indexer-key blocks [..., E, W] (W = index_entry_bytes(dim), contiguous blocks) -> views
    (codes [..., E, dim/2], scales [..., E, dim/32]) of their block layout."""
    *lead, e, w = pool.shape
    flat = pool.view(*lead, e * w)
    c = dim // 2
    return flat[..., : e * c].unflatten(-1, (e, c)), flat[..., e * c:].unflatten(-1, (e, w - c))


def index_block_rows(pool: torch.Tensor, blocks: torch.Tensor, offs: torch.Tensor, dim: int) -> torch.Tensor:
    """The packed rows of entries (blocks, offs) of indexer-key blocks [num_blocks, E, W], gathered
    from the block layout without converting the whole pool."""
    codes, scales = index_block_views(pool, dim)
    return torch.cat([codes[blocks, offs], scales[blocks, offs]], dim=-1)


def index_blocks_to_rows(blocks: torch.Tensor, dim: int) -> torch.Tensor:
    """Packed indexer-key blocks [..., E, W] -> the same keys as packed rows [..., E, W]."""
    codes, scales = index_block_views(blocks.contiguous(), dim)
    return torch.cat([codes, scales], dim=-1)


def index_rows_to_blocks(rows: torch.Tensor, dim: int) -> torch.Tensor:
    """Packed indexer-key rows [..., E, W] -> the block layout (same shape and bytes, reordered)."""
    c = dim // 2
    return torch.cat([rows[..., :c].flatten(-2), rows[..., c:].flatten(-2)], dim=-1).view(rows.shape)


V41_GLOBAL_TILE = 16
V41_WINDOW_TILE = 32


def v41_global_bytes(dim: int) -> int:
    return dim // 2 + dim // V41_GLOBAL_TILE


def v41_window_bytes(dim: int) -> int:
    return dim + dim // V41_WINDOW_TILE


def pack_v41_global(x: torch.Tensor, check: bool = True) -> torch.Tensor:
    """[N, d] global KV entries (on the FP4 grid with e4m3 scales per 16) -> uint8 [N, d/2 + d/16].

    The scale of a block is recovered exactly: it is amax / m for the E2M1 magnitude m its largest
    value was quantised to. Usually m = 6 (the scale quant_fp4 would pick again), but with e4m3
    subnormal scales (tiny blocks) rounding can leave the largest value at 4 or less, so every
    magnitude is tried at once and the first (largest) whose scale reproduces the whole block is
    kept. `check`: skip the search when quant_fp4 reproduces every block, and raise where no scale
    does (both read the device's answer on the host); without it (a decode step captured in a CUDA
    graph) the search always runs and a block no scale reproduces keeps quant_fp4's."""
    if (kernels := _kernel(x)) is not None:
        packed, failed = kernels.pack_v41_global(x, V41_GLOBAL_TILE)
        if check and bool(failed.any()):
            raise ValueError("global KV values are not on the FP4 grid with e4m3 scales per 16")
        return packed
    n, d = x.shape
    blocks = x.float().reshape(n, d // V41_GLOBAL_TILE, V41_GLOBAL_TILE)
    q, scale = quant_fp4(x.float(), V41_GLOBAL_TILE, "e4m3")       # the usual case, and all-zero blocks
    q = q.reshape(blocks.shape)
    ok = (q * scale.unsqueeze(-1) == blocks).all(-1)
    if not check or not bool(ok.all()):
        mags = e2m1_magnitude(torch.arange(6, 0, -1, device=x.device))      # 4, 3, 2, 1.5, 1, 0.5
        s = (blocks.abs().amax(-1, keepdim=True) / mags).to(torch.float8_e4m3fn).float()     # [N, B, M]
        qm = blocks.unsqueeze(-2) / s.clamp(min=torch.finfo(torch.float32).tiny).unsqueeze(-1)  # [N, B, M, 16]
        rq = e2m1_round(qm)
        fits = ((rq == qm) & (qm.abs() <= 6) & (rq * s.unsqueeze(-1) == blocks.unsqueeze(-2))).all(-1)
        first = fits.int().argmax(-1, keepdim=True)                    # the largest magnitude that fits
        take = ~ok & fits.any(-1)
        q = torch.where(take.unsqueeze(-1), rq.gather(-2, first.unsqueeze(-1).expand(-1, -1, 1, rq.shape[-1]))
                        .squeeze(-2), q)
        scale = torch.where(take, s.gather(-1, first).squeeze(-1), scale)
        ok = ok | take
    if check and not bool(ok.all()):
        raise ValueError("global KV values are not on the FP4 grid with e4m3 scales per 16")
    codes = pack_fp4(q.reshape(n, d), check=check).view(torch.uint8)
    return torch.cat([codes, scale.to(torch.float8_e4m3fn).view(torch.uint8)], dim=1)


def unpack_v41_global(buf: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    vals = unpack_fp4(buf[:, : dim // 2].contiguous()).reshape(n, dim // V41_GLOBAL_TILE, V41_GLOBAL_TILE)
    scale = buf[:, dim // 2:].contiguous().view(torch.float8_e4m3fn).float()
    return (vals * scale.unsqueeze(-1)).reshape(n, dim).to(dtype)


def pack_v41_window(x: torch.Tensor) -> torch.Tensor:
    """[N, d] window rows (on the FP8 grid with power-of-two scales per 32) -> uint8 [N, d + d/32]."""
    if (kernels := _kernel(x)) is not None:
        return kernels.pack_v41_window(x, V41_WINDOW_TILE)
    n, d = x.shape
    blocks = x.float().reshape(n, d // V41_WINDOW_TILE, V41_WINDOW_TILE)
    scale = pow2_scale(blocks.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR), 448.0)
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).reshape(n, d).view(torch.uint8)
    return torch.cat([q, _e8m0_bytes(scale)], dim=1)


def unpack_v41_window(buf: torch.Tensor, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = buf.shape[0]
    q = buf[:, :dim].contiguous().view(torch.float8_e4m3fn).float().reshape(n, dim // V41_WINDOW_TILE, V41_WINDOW_TILE)
    scale = _from_e8m0(buf[:, dim:])
    return (q * scale.unsqueeze(-1)).reshape(n, dim).to(dtype)
