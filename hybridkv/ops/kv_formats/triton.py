"""Triton kernels of the packings a decode step runs (`pack_index_fp4`, `pack_v41_global`,
`pack_v41_window`): one program per entry, the same bytes as the plain-torch definitions in
`hybridkv.ops.kv_formats`, which take from ten to forty launches each. The indexer keys' and global
entries' packings also store straight into a paged pool (`dest`): entry n of the rows becomes entry
ids[n] of request which[n], through its block table, or is not stored where ids[n] is −1 (a decode
step's fixed shapes: every request computes a candidate entry)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.reference import FP4_AMAX_FLOOR, FP4_E4M3_AMAX_FLOOR, FP4_MAX, FP8_AMAX_FLOOR, FP8_MAX
from hybridkv.ops.quant.triton import _e2m1_round, _e4m3_round, _e4m3_saturate, _pow2_ceil_exp

# the kernels read module constants as constexprs (the GPU's compiler refuses plain globals)
TINY = tl.constexpr(1.1754943508222875e-38)       # torch.finfo(torch.float32).tiny
FP4_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
FP4_E4M3_FLOOR = tl.constexpr(FP4_E4M3_AMAX_FLOOR)
FP8_FLOOR = tl.constexpr(FP8_AMAX_FLOOR)
INV_FP4_MAX = tl.constexpr(1.0 / FP4_MAX)
INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
E2M1_MAX = tl.constexpr(FP4_MAX)
E2M1_BELOW_MAX = tl.constexpr((0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0))    # E2M1 magnitudes by code 0..6


@triton.jit
def _e2m1_codes(v):
    """`pack_fp4`'s codes of values v (float32): magnitude code 0..7 (0, 0.5, 1, 1.5 -> 0..3; 2, 3 ->
    4, 5; 4, 6 -> 6, 7; truncated as the reference's integer conversion), bit 3 the sign of v ≠ 0."""
    mag = tl.abs(v)
    code = tl.where(mag < 2, mag * 2, tl.where(mag < 4, mag + 2, mag * 0.5 + 4))
    code = tl.minimum(tl.maximum(code, 0.0), 7.0).to(tl.int32)
    neg = ((v.to(tl.int32, bitcast=True) < 0) & (mag > 0)).to(tl.int32)
    return code | (neg << 3)


@triton.jit
def _store_nibbles(dst, codes, D: tl.constexpr, ok):
    """codes [D // T, T] int32 (row-major = element order) -> D/2 bytes, low nibble the even element."""
    lo, hi = tl.split(tl.reshape(codes, [D // 2, 2]))
    i = tl.arange(0, D // 2)
    tl.store(dst + i, (lo | (hi << 4)).to(tl.uint8), mask=(i >= 0) & ok)


@triton.jit
def _dest(OUT, n, TABLES, s_tables, WHICH, IDS, PER, s_blk, s_slot, D: tl.constexpr, T: tl.constexpr,
          PAGED: tl.constexpr, BLOCKS: tl.constexpr):
    """(where entry n's D/2 code bytes go, where its D/T scale bytes go, whether it is stored): row n
    of OUT [N, D/2 + D/T]; PAGED, entry IDS[n] of request WHICH[n] in the pool OUT through its block
    table (rows of a block s_slot apart; BLOCKS: a block's codes first, then its scales)."""
    if PAGED:
        e = tl.load(IDS + n)
        ok = e >= 0
        e = tl.maximum(e, 0)
        r = tl.load(WHICH + n).to(tl.int64)
        blk = tl.load(TABLES + r * s_tables + e // PER).to(tl.int64)
        slot = (e % PER).to(tl.int64)
        base = OUT + blk * s_blk
        if BLOCKS:
            return base + slot * (D // 2), base + PER * (D // 2) + slot * (D // T), ok
        return base + slot * s_slot, base + slot * s_slot + D // 2, ok
    row = OUT + n.to(tl.int64) * (D // 2 + D // T)
    return row, row + D // 2, n >= 0


@triton.jit
def _row(X, s_x, D: tl.constexpr, T: tl.constexpr):
    n = tl.program_id(0)
    x = tl.load(X + n.to(tl.int64) * s_x + tl.arange(0, D)).to(tl.float32)
    return n, tl.reshape(x, [D // T, T])


@triton.jit
def pack_index_fp4_kernel(X, s_x, OUT, TABLES, s_tables, WHICH, IDS, PER, s_blk, s_slot, D: tl.constexpr,
                          T: tl.constexpr, PAGED: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    n, x = _row(X, s_x, D, T)
    sexp = _pow2_ceil_exp(tl.maximum(tl.max(tl.abs(x), 1), FP4_FLOOR), INV_FP4_MAX)
    inv = ((254 - sexp) << 23).to(tl.float32, bitcast=True)         # 1/scale, exact for a power of two
    codes, scales, ok = _dest(OUT, n, TABLES, s_tables, WHICH, IDS, PER, s_blk, s_slot, D, T, PAGED, BLOCKS)
    _store_nibbles(codes, _e2m1_codes(x * inv[:, None]), D, ok)
    i = tl.arange(0, D // T)
    tl.store(scales + i, sexp.to(tl.uint8), mask=(i >= 0) & ok)


@triton.jit
def pack_v41_window_kernel(X, s_x, OUT, D: tl.constexpr, T: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    n, x = _row(X, s_x, D, T)
    sexp = _pow2_ceil_exp(tl.maximum(tl.max(tl.abs(x), 1), FP8_FLOOR), INV_FP8_MAX)
    inv = ((254 - sexp) << 23).to(tl.float32, bitcast=True)
    q = x * inv[:, None]
    # the magnitude's e4m3 bits and the sign apart: a value that rounds to zero keeps its sign (−0 is
    # 0x80, as torch converts it)
    mag = _e4m3_round(tl.abs(q)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    codes = mag | ((q.to(tl.int32, bitcast=True) < 0).to(tl.uint8) << 7)
    dst = OUT + n.to(tl.int64) * (D + D // T)
    tl.store(dst + tl.arange(0, D), tl.reshape(codes, [D]))
    tl.store(dst + D + tl.arange(0, D // T), sexp.to(tl.uint8))


@triton.jit
def _fits(x, amax, m):
    """`pack_v41_global`'s search at E2M1 magnitude m: (whether every value of a block is rq · s for
    s = e4m3(amax / m) and rq = x / s on the grid, rq, s)."""
    s = _e4m3_saturate(tl.math.div_rn(amax, m))
    qm = tl.math.div_rn(x, tl.maximum(s, TINY)[:, None])
    rq = _e2m1_round(tl.minimum(tl.maximum(qm, -7.0), 7.0))   # (|qm| > 6 never fits; inf is kept out of the rounding)
    ok = (rq == qm) & (tl.abs(qm) <= 6.0) & (rq * s[:, None] == x)
    return tl.min(ok.to(tl.int32), 1) > 0, rq, s


@triton.jit
def _take(found, fits, rq, s, q, scale):
    upd = fits & ~found
    return found | fits, tl.where(upd[:, None], rq, q), tl.where(upd, s, scale)


@triton.jit
def pack_v41_global_kernel(X, s_x, OUT, TABLES, s_tables, WHICH, IDS, PER, s_blk, s_slot, FAILED, D: tl.constexpr,
                           T: tl.constexpr, PAGED: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    n, x = _row(X, s_x, D, T)
    amax = tl.max(tl.abs(x), 1)
    # quant_fp4's choice, e4m3(max(amax, floor) / 6), then the largest magnitude whose scale fits
    scale = _e4m3_saturate(tl.math.div_rn(tl.maximum(amax, FP4_E4M3_FLOOR), E2M1_MAX))
    q = _e2m1_round(tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -E2M1_MAX), E2M1_MAX))
    found = tl.min((q * scale[:, None] == x).to(tl.int32), 1) > 0
    for code in tl.static_range(6, 0, -1):      # magnitudes 4, 3, 2, 1.5, 1, 0.5: the first that fits
        fits, rq, s = _fits(x, amax, E2M1_BELOW_MAX[code])
        found, q, scale = _take(found, fits, rq, s, q, scale)
    codes, scales, ok = _dest(OUT, n, TABLES, s_tables, WHICH, IDS, PER, s_blk, s_slot, D, T, PAGED, BLOCKS)
    _store_nibbles(codes, _e2m1_codes(q), D, ok)
    i = tl.arange(0, D // T)
    tl.store(scales + i, scale.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=(i >= 0) & ok)
    tl.store(FAILED + n, tl.sum((~found).to(tl.int32), 0))


@dataclass
class PagedDest:
    """Where packed entries go in a paged pool: pool [blocks, E, width] uint8 (each block contiguous
    where `block_layout`), tables [R, ≥ blocks a request holds] of pool block ids, entry n to entry
    ids[n] (−1: not stored) of request which[n]."""
    pool: torch.Tensor
    tables: torch.Tensor
    which: torch.Tensor
    ids: torch.Tensor
    block_layout: bool


def _run(kernel, x: torch.Tensor, out: torch.Tensor, tile: int, *args, **flags) -> torch.Tensor:
    """One program per row of x [N, d], writing `out` (returned)."""
    n, d = x.shape
    if n:
        xc = x if x.stride(-1) == 1 else x.contiguous()
        kernel[(n,)](xc, xc.stride(0), out, *args, D=d, T=tile, **flags, num_warps=4, **triton_args(xc))
    return out


def _dest_args(x: torch.Tensor, width: int, dest: PagedDest | None) -> tuple[torch.Tensor, tuple, dict]:
    """(the tensor the kernel writes, its destination arguments, their constexprs)."""
    if dest is None:
        out = torch.empty(x.shape[0], width, dtype=torch.uint8, device=x.device)
        return out, (out, 0, out, out, 1, 0, 0), dict(PAGED=False, BLOCKS=False)
    pool = dest.pool
    if pool.dtype != torch.uint8 or pool.shape[-1] != width or pool.stride(-1) != 1 or (
            dest.block_layout and (pool.stride(1) != width or pool.stride(0) < pool.shape[1] * width)):
        raise ValueError(f"packed entries of {width} B: pool {tuple(pool.shape)} {pool.dtype} strides {pool.stride()}")
    return pool, (dest.tables, dest.tables.stride(0), dest.which, dest.ids, pool.shape[1], pool.stride(0),
                  pool.stride(1)), dict(PAGED=True, BLOCKS=dest.block_layout)


def _pack(kernel, x: torch.Tensor, tile: int, dest: PagedDest | None, *extra) -> torch.Tensor:
    out, where, flags = _dest_args(x, x.shape[1] // 2 + x.shape[1] // tile, dest)
    return _run(kernel, x, out, tile, *where, *extra, **flags)


def pack_index_fp4(x: torch.Tensor, tile: int, dest: PagedDest | None = None) -> torch.Tensor:
    """The packed keys [N, d/2 + d/32], or with `dest` stored into its pool (which is returned)."""
    return _pack(pack_index_fp4_kernel, x, tile, dest)


def pack_v41_window(x: torch.Tensor, tile: int) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] + x.shape[1] // tile, dtype=torch.uint8, device=x.device)
    return _run(pack_v41_window_kernel, x, out, tile)


def pack_v41_global(x: torch.Tensor, tile: int, dest: PagedDest | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the packed entries, or with `dest` its pool, into which they were stored; int32 [N]: how many
    blocks of each entry no scale reproduces)."""
    failed = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
    return _pack(pack_v41_global_kernel, x, tile, dest, failed), failed
