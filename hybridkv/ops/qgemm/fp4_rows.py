"""The routed experts' packed FP4 GEMM at decode sizes: one sorted row per program, on the CUDA
cores. At decode an expert sees one or two rows, so a tensor-core tile is mostly padding, and what
bounds the step is the work of turning each packed code into an operand (Triton's scaled dot, in
the tile kernel, widens codes to bf16 and stages them through shared memory for the MMA). Here the
weight is read as 32-bit words of eight E2M1 codes, and each code becomes a float32 by moving its
bits into place (two shifts, two masks: the value times 2^-126, exactly), then one FMA with the
activation, which is read times 2^100 so that the products stay normal float32 numbers (an
activation below about 2^-20 would otherwise make subnormal products; |x| < 2^28 keeps it finite);
the e8m0 scale (times 2^26) multiplies each word's partial sum. Each program loads
the next K block before it computes this one. Rows that share an expert are adjacent programs of
the grid, so their second read of the weight comes from L2.

Same contract as `triton.grouped_fp4` (whose tile table, built with one row per tile, it reads):
activations already through their FP8 round trip, products exact in float32, only the order of
the float32 additions differs from the tensor-core kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.qgemm.layout import FP4_BLOCK, _e8m0, _expert_base

WORD = 8                     # E2M1 codes per 32-bit word


@triton.jit
def _e2m1_plane(words, J: tl.constexpr):
    """Code J (bits 4J..4J+3) of each uint32 word -> its E2M1 value times 2^-126 as float32: the
    three magnitude bits land on the exponent's two low bits and the mantissa's top bit (a zero
    exponent is the subnormal 0.5 · 2^-126), the sign bit on bit 31."""
    MAG: tl.constexpr = 22 - 4 * J
    SIGN: tl.constexpr = 28 - 4 * J
    if MAG >= 0:
        mag = words << MAG
    else:
        mag = words >> -MAG
    bits = (mag & 0x01C00000) | ((words << SIGN) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_block(w, sc, rn, n_ok, c, kb, live, w_words, s_stride, BN: tl.constexpr, BK: tl.constexpr):
    """K block kb of BN weight rows: words [BN, BK/8] and each word's 32-value group scale as float32
    (e8m0 · 2^126), nothing read where not `live`."""
    ok = n_ok[:, None] & live
    words = tl.load(w + rn.to(tl.int64)[:, None] * w_words + kb * (BK // 8) + c[None, :], mask=ok, other=0)
    g = tl.arange(0, BK // 32)
    s = tl.load(sc + rn.to(tl.int64)[:, None] * s_stride + kb * (BK // 32) + g[None, :], mask=ok, other=127)
    s = tl.reshape(tl.broadcast_to(s[:, :, None], (BN, BK // 32, 4)), (BN, BK // 8))
    scale = _e8m0(s) * 67108864.0          # 2^26: with the activations' 2^100, undoes the placement's 2^-126
    return words.to(tl.uint32, bitcast=True), scale


@triton.jit
def _block_dot(acc, words, scale, xrow, c, kb, BK: tl.constexpr):
    """acc [BN, BK/8] + each word's eight codes × their activations, times the word's scale."""
    part = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        x = tl.load(xrow + kb * BK + c * 8 + j).to(tl.float32) * 1.2676506002282294e30   # [BK/8] · 2^100, shared by the rows
        part += _e2m1_plane(words, j) * x[None, :]
    return acc + part * scale


@triton.jit
def grouped_fp4_rows_kernel(X, ROWS, TILE_E, TILE_S, WP1, SP1, WP3, SP3, ROUTE, Y, N, K, w_words, s_stride,
                            ew_stride, es_stride, stride_x, limit,
                            GATHER: tl.constexpr, SWIGLU: tl.constexpr, TABLE: tl.constexpr,
                            BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(TILE_E + pid_m)
    if e < 0:
        return
    r = tl.load(TILE_S + pid_m)                    # one row per tile
    src = tl.load(ROWS + r) if GATHER else r
    xrow = X + src.to(tl.int64) * stride_x
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    c = tl.arange(0, BK // 8)
    n_kb = K // BK
    # the packed weight read as 32-bit words of eight codes
    w1 = _expert_base(WP1, e, ew_stride, TABLE).to(tl.pointer_type(tl.int32))
    s1 = _expert_base(SP1, e, es_stride, TABLE)
    w3, s3 = w1, s1
    if SWIGLU:
        w3 = _expert_base(WP3, e, ew_stride, TABLE).to(tl.pointer_type(tl.int32))
        s3 = _expert_base(SP3, e, es_stride, TABLE)
    acc1 = tl.zeros((BN, BK // 8), dtype=tl.float32)
    acc3 = tl.zeros((BN, BK // 8), dtype=tl.float32)
    # the next block's loads are issued before this block's arithmetic, so that each program keeps
    # a block of weight bytes in flight while it computes
    words1, scale1 = _load_block(w1, s1, rn, n_ok, c, 0, True, w_words, s_stride, BN, BK)
    words3, scale3 = words1, scale1
    if SWIGLU:
        words3, scale3 = _load_block(w3, s3, rn, n_ok, c, 0, True, w_words, s_stride, BN, BK)
    for kb in range(0, n_kb):
        live = kb + 1 < n_kb
        next1, nscale1 = _load_block(w1, s1, rn, n_ok, c, kb + 1, live, w_words, s_stride, BN, BK)
        if SWIGLU:
            next3, nscale3 = _load_block(w3, s3, rn, n_ok, c, kb + 1, live, w_words, s_stride, BN, BK)
            acc3 = _block_dot(acc3, words3, scale3, xrow, c, kb, BK)
            words3, scale3 = next3, nscale3
        acc1 = _block_dot(acc1, words1, scale1, xrow, c, kb, BK)
        words1, scale1 = next1, nscale1
    if SWIGLU:
        # each projection's output is rounded to the compute dtype, as `Linear` returns it
        gate = tl.sum(acc1, 1).to(Y.dtype.element_ty).to(tl.float32)
        up = tl.sum(acc3, 1).to(Y.dtype.element_ty).to(tl.float32)
        if limit > 0:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        out = tl.load(ROUTE + r) * (gate * tl.sigmoid(gate) * up)
    else:
        out = tl.sum(acc1, 1)
    tl.store(Y + r.to(tl.int64) * N + rn, out.to(Y.dtype.element_ty), mask=n_ok)


def row_block_k(k: int, want: int = 256) -> int:
    """The deepest power-of-two K block (≤ want, ≥ 128) dividing k."""
    bk = want
    while bk > 128 and k % bk:
        bk //= 2
    return bk


def grouped_fp4_rows(x: torch.Tensor, rows: torch.Tensor | None, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     w1: tuple[torch.Tensor, torch.Tensor], n: int, out_dtype: torch.dtype, y: torch.Tensor,
                     w3: tuple[torch.Tensor, torch.Tensor] | None, route: torch.Tensor | None, limit: float,
                     strides: tuple[int, int], table: bool, config: dict) -> torch.Tensor:
    """The launch behind `triton.grouped_fp4` for one-row tiles (config BM 1; the caller checked the
    layout). config: BN (weight rows per program), BK (inputs per loop step, a power of two ≥ 128
    dividing K; the deepest up to 256 when absent), num_warps."""
    k = x.shape[-1]
    cfg = dict(config)
    cfg.pop("BM")
    cfg.pop("num_stages", None)
    bk = cfg.pop("BK", None) or row_block_k(k)
    if bk < 128 or bk & (bk - 1) or k % bk:
        raise ValueError(f"grouped FP4 rows: BK {bk} must be a power of two ≥ 128 dividing K = {k}")
    swiglu = w3 is not None
    grid = (tiles[0].shape[0], triton.cdiv(n, cfg["BN"]))
    grouped_fp4_rows_kernel[grid](
        x, rows if rows is not None else tiles[0], tiles[0], tiles[1], w1[0], w1[1], *(w3 if swiglu else w1),
        route if swiglu else x, y, n, k, k // WORD, k // FP4_BLOCK, strides[0], strides[1], x.stride(0), float(limit),
        GATHER=rows is not None, SWIGLU=swiglu, TABLE=table, BK=bk, **cfg)
    return y
