"""Triton GEMMs that read the release's packed weights; no dense copy of a weight is ever made.

- `fp8_linear`: e4m3 weight [N, K] with one e8m0 scale per 128×128 tile. Each program dequantises
  its weight tile in registers (e4m3 and the power-of-two scale are exact in bf16) and runs the
  MMA in bf16 with fp32 accumulation; the input's FP8 round trip per 128 values (`act_quant_sim`)
  is done in the same program on the tile it loads, bit-identical with the one-launch kernel of
  `hybridkv.ops.quant`. Two configurations: decode (≤ 64 rows: 16-row tiles, the K loop split
  over programs so that a few rows still spread over every SM, partial sums added by one torch
  sum) and prefill (128×128 tiles, grouped launch order for L2 reuse).
- `grouped_fp4`: the routed experts' packed E2M1 weights (two per byte, low nibble = even element,
  e8m0 scale per 32 inputs) over rows sorted by expert (`hybridkv.ops.grouped_moe`), one launch
  for all experts: each program owns a tile of one expert's rows (the tile table says which) and
  reads that expert's weight through a table of per-expert addresses (the experts stay separate
  parameters, no stacking copy). With `swiglu` the program runs w1 and w3 together and writes the
  clamped SwiGLU times the routing weight, what w2 reads.

Under the interpreter (CPU tests) the MMA runs in fp32: the interpreter's bf16 dot is not usable.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hybridkv.ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX
from hybridkv.ops.quant.triton import _e4m3_round

SCALE_BLOCK = 128      # FP8 weights: the scale tile, also the K step and the activation block
FP4_BLOCK = 32
NUM_SMS_GUESS = 132    # H200; only sizes the decode split


def _dot_dtype():
    return tl.float32 if os.environ.get("TRITON_INTERPRET", "0") == "1" else tl.bfloat16


@triton.jit
def _act_quant(x, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """Each row of x [R, block] through the FP8 round trip with a power-of-two scale (as
    `hybridkv.ops.quant.triton.fp8_round_trip_kernel`)."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), FLOOR)
    t = amax * (1.0 / QMAX)
    s_bits = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    s = s_bits.to(tl.float32, bitcast=True)
    inv = (0x7F000000 - s_bits).to(tl.float32, bitcast=True)
    q = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
    return _e4m3_round(q) * s[:, None]


@triton.jit
def _e8m0(s):
    """e8m0 bytes (as uint8) -> 2^(s-127) in float32."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(nib):
    """4-bit E2M1 codes (int32, bit 3 the sign) -> float32 values."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e > 0, ((126 + e) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def fp8_gemm_kernel(X, W, WS, Y, M, N, K, stride_xm, stride_ym, stride_ys, ws_stride, QUANT_X: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, DOT: tl.constexpr,
                    FLOOR: tl.constexpr, QMAX: tl.constexpr):
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    n_kb = K // BK
    per = tl.cdiv(n_kb, SPLIT_K)
    kb0 = pid_k * per
    kb1 = tl.minimum(kb0 + per, n_kb)
    srow = (pid_n * BN) // BK          # BN divides the 128-row scale tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        x = tl.load(X + rm.to(tl.int64)[:, None] * stride_xm + (kb * BK + rk)[None, :], mask=m_ok[:, None],
                    other=0.0).to(tl.float32)
        if QUANT_X:
            x = _act_quant(x, FLOOR, QMAX)
        w = tl.load(W + rn.to(tl.int64)[:, None] * K + (kb * BK + rk)[None, :], mask=n_ok[:, None], other=0.0)
        s = _e8m0(tl.load(WS + srow * ws_stride + kb))
        acc += tl.dot(x.to(DOT), tl.trans(w.to(DOT))) * s
    out = Y + pid_k.to(tl.int64) * stride_ys
    tl.store(out + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fp8_config(m: int, n: int, k: int) -> dict:
    """Tile sizes for an [m, k] × [n, k]ᵀ FP8 GEMM: decode-shaped (few rows) or prefill-shaped."""
    if m <= 64:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn = 64
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        n_kb = k // SCALE_BLOCK
        split = 1
        while split * 2 <= n_kb // 2 and tiles * split < 2 * NUM_SMS_GUESS:
            split *= 2
        return dict(BM=bm, BN=bn, SPLIT_K=split, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=3)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               quant_x: bool = True, config: dict | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] of out_dtype, the weight e4m3 [N, K] with e8m0 scales per 128×128
    tile; the input goes through the FP8 round trip per 128 values unless quant_x is False."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    cfg = dict(config or fp8_config(m, n, k))
    split = cfg.pop("SPLIT_K")
    y = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else \
        torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]), split)
        fp8_gemm_kernel[grid](
            x2, weight, scale.view(torch.uint8), y, m, n, k, x2.stride(0), n, m * n, scale.stride(0),
            QUANT_X=quant_x, BK=SCALE_BLOCK, SPLIT_K=split, DOT=_dot_dtype(), FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX,
            **cfg)
    if split > 1:
        y = y.sum(0).to(out_dtype)
    return y.view(*lead, n)


def fp8_supported(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    return tuple(block) == (SCALE_BLOCK, SCALE_BLOCK) and weight.shape[1] % SCALE_BLOCK == 0


@triton.jit
def grouped_fp4_kernel(X, ROWS, TILE_E, TILE_S, TILE_T, WP1, SP1, WP3, SP3, ROUTE, Y, N, K, stride_x, limit,
                       GATHER: tl.constexpr, SWIGLU: tl.constexpr, QUANT_X: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                       FLOOR: tl.constexpr, QMAX: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(TILE_E + pid_m)
    if e < 0:
        return
    start, end = tl.load(TILE_S + pid_m), tl.load(TILE_T + pid_m)
    r = start + tl.arange(0, BM)
    r_ok = r < end
    src = tl.load(ROWS + r, mask=r_ok, other=0) if GATHER else r
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    w1 = tl.load(WP1 + e).to(tl.pointer_type(tl.uint8))
    s1 = tl.load(SP1 + e).to(tl.pointer_type(tl.uint8))
    if SWIGLU:
        w3 = tl.load(WP3 + e).to(tl.pointer_type(tl.uint8))
        s3 = tl.load(SP3 + e).to(tl.pointer_type(tl.uint8))
    rb = tl.arange(0, BK // 2)
    rs = tl.arange(0, BK // 32)
    wrow = rn.to(tl.int64)[:, None] * (K // 2)
    srow = rn.to(tl.int64)[:, None] * (K // 32)
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        x = tl.load(X + src.to(tl.int64)[:, None] * stride_x + (kb * BK + tl.arange(0, BK))[None, :],
                    mask=r_ok[:, None], other=0.0).to(tl.float32)
        if QUANT_X:
            x = _act_quant(x, FLOOR, QMAX)
        x = x.to(DOT)
        b = tl.load(w1 + wrow + (kb * (BK // 2) + rb)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        s = _e8m0(tl.load(s1 + srow + (kb * (BK // 32) + rs)[None, :], mask=n_ok[:, None], other=127))
        w = tl.reshape(tl.reshape(tl.interleave(_e2m1(b & 15), _e2m1(b >> 4)), (BN, BK // 32, 32)) * s[:, :, None],
                       (BN, BK))
        acc1 += tl.dot(x, tl.trans(w.to(DOT)))
        if SWIGLU:
            b = tl.load(w3 + wrow + (kb * (BK // 2) + rb)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
            s = _e8m0(tl.load(s3 + srow + (kb * (BK // 32) + rs)[None, :], mask=n_ok[:, None], other=127))
            w = tl.reshape(tl.reshape(tl.interleave(_e2m1(b & 15), _e2m1(b >> 4)), (BN, BK // 32, 32))
                           * s[:, :, None], (BN, BK))
            acc3 += tl.dot(x, tl.trans(w.to(DOT)))
    if SWIGLU:
        # each projection's output is rounded to the compute dtype, as `Linear` returns it
        gate = acc1.to(Y.dtype.element_ty).to(tl.float32)
        up = acc3.to(Y.dtype.element_ty).to(tl.float32)
        if limit > 0:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        route = tl.load(ROUTE + r, mask=r_ok, other=0.0)
        out = route[:, None] * (gate * tl.sigmoid(gate) * up)
    else:
        out = acc1
    tl.store(Y + r.to(tl.int64)[:, None] * N + rn[None, :], out.to(Y.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


def grouped_config(pairs: int, n: int) -> dict:
    """Row tile and column tile of the grouped FP4 GEMM: decode (a row or two per expert) wants small
    row tiles and many column programs; prefill 64-row tiles."""
    if pairs <= 512:
        return dict(BM=16, BN=64, num_warps=4, num_stages=3)
    return dict(BM=64, BN=128, num_warps=8, num_stages=3)


def grouped_fp4(x: torch.Tensor, rows: torch.Tensor | None, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                w1: tuple[torch.Tensor, torch.Tensor], n: int, out_dtype: torch.dtype,
                w3: tuple[torch.Tensor, torch.Tensor] | None = None, route: torch.Tensor | None = None,
                limit: float = 0.0, quant_x: bool = True, config: dict | None = None) -> torch.Tensor:
    """Sorted rows P (x[rows[i]] for row i, or x's own rows with rows None) × their experts' packed
    weights -> [P, n] of out_dtype. `tiles` = (expert, first row, end row) per row tile, built by
    `hybridkv.ops.grouped_moe.expert_tiles` with the same BM; w1/w3 = (weight addresses, scale
    addresses) per expert. With w3 the SwiGLU of (w1, w3) times `route` [P] is returned."""
    cfg = dict(config or grouped_config(rows.shape[0] if rows is not None else x.shape[0], n))
    p = rows.shape[0] if rows is not None else x.shape[0]
    k = x.shape[-1]
    y = torch.empty(p, n, dtype=out_dtype, device=x.device)
    if p == 0:
        return y
    swiglu = w3 is not None
    grid = (tiles[0].shape[0], triton.cdiv(n, cfg["BN"]))
    grouped_fp4_kernel[grid](
        x, rows if rows is not None else tiles[0], *tiles, w1[0], w1[1], *(w3 if swiglu else w1),
        route if swiglu else x, y, n, k, x.stride(0), float(limit), GATHER=rows is not None, SWIGLU=swiglu,
        QUANT_X=quant_x, BK=SCALE_BLOCK, DOT=_dot_dtype(), FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX, **cfg)
    return y
