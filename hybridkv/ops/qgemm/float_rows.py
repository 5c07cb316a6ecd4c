"""Few-row GEMMs with a float32 result over weights read as they are stored (bf16, fp16 or float32):
the decode path of the widened linears (the compressors' and the indexer's projections, several
stacked in one weight, see `hybridkv.model.linear.stack_storage`; float32-stored ones times a bf16
input).

One launch: [BM, BN] tiles, the K loop split over programs so that a few rows still spread over
every SM, and the last of a tile's programs to arrive adds the partial sums in split order (the
protocol of `triton.fp8_gemm_kernel`). bf16 × bf16 runs on the tensor cores (its products are exact
in float32); a float32 weight (or input) in float32, the precision of torch's float32 GEMM: with at
most `GEMV_ROWS` rows as products summed over K on the CUDA cores (`gemv_kernel`: the MoE gates'
float32 weights at decode, and a speculative step's verify rows), beyond as IEEE dots. What differs from torch is the order of the float32
additions only. Larger inputs (prefill) stay with torch's GEMMs (`widened_rows_ok`).

The GEMV takes no K split: each program owns a few weight rows over all of K, holds each product in
its own lane until one reduction at the end, and loads its first chunk of weights before it waits
for the previous kernel (programmatic dependent launch: no earlier kernel writes a weight): a read
of a few MB needs no round of atomics and partial sums after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import interpreting
from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.qgemm.triton import NUM_SMS_GUESS, _arrivals, _split_k_arrive, _split_k_total

MAX_ROWS = 64              # more rows: torch's GEMM
MAX_WEIGHT_BYTES = 64 << 20  # larger weights (the head) already run at their byte time in cuBLAS
# float32 operands with at most this many rows: products summed on the CUDA cores. H200, V4-Flash
# 8-block decode (2026-12-04, the split-K form of the GEMV then): the 8 MoE-gate launches of a B=1
# step 45 µs faster than as IEEE dots, those of a B=8 step 7 µs slower. Four rows: a speculative
# step's k + 1 ≤ 4 verify rows of one request take it too (as IEEE dots each launch took ~8 µs on
# the H100 at three rows, the tiny model's step)
GEMV_ROWS = 4
GEMV_BN, GEMV_BK, GEMV_WARPS = 2, 1024, 4      # weight rows a program, K chunk, warps


@triton.jit
def split_tile(M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's [BM, BN] tile of a split-K launch (grid: tiles, SPLIT_K) and its share of the
    BK-deep blocks: (tile, pid_k, rows, columns, first block, end block)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BN)
    rm = (pid // num_n) * BM + tl.arange(0, BM)
    rn = (pid % num_n) * BN + tl.arange(0, BN)
    n_kb = tl.cdiv(K, BK)
    per = tl.cdiv(n_kb, SPLIT_K)
    kb0 = pid_k * per
    return pid, pid_k, rm, rn, kb0, tl.minimum(kb0 + per, n_kb)


@triton.jit
def store_split_tile(Y, stride_y, acc, P, CNT, pid, pid_k, rm, rn, M, N, SPLIT_K: tl.constexpr,
                     FENCE: tl.constexpr):
    """Y[rm, rn] = the tile's sum: this program's `acc` where K is not split, else its share stored
    and, by the last program of the tile to arrive, the shares added in split order."""
    ok = (rm < M)[:, None] & (rn < N)[None, :]
    out = Y + rm.to(tl.int64)[:, None] * stride_y + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc, mask=ok)
    else:
        at = rm.to(tl.int64)[:, None] * N + rn[None, :]
        if _split_k_arrive(P, CNT, pid, pid_k, at, acc, ok, M, N, SPLIT_K, FENCE):
            tl.store(out, _split_k_total(P, CNT, pid, at, ok, M, N, SPLIT_K, FENCE), mask=ok)


@triton.jit
def rows_gemm_kernel(X, W, Y, P, CNT, M, N, K, stride_x, stride_w, stride_y,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                     IEEE: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    pid, pid_k, rm, rn, kb0, kb1 = split_tile(M, N, K, BM, BN, BK, SPLIT_K)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k = kb * BK + rk
        k_ok = k < K
        x = tl.load(X + rm.to(tl.int64)[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(W + rn.to(tl.int64)[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    store_split_tile(Y, stride_y, acc, P, CNT, pid, pid_k, rm, rn, M, N, SPLIT_K, FENCE)



@triton.jit
def gemv_kernel(X, W, Y, M, N, K, stride_x, stride_w, stride_y,
                BN: tl.constexpr, BK: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr):
    """x [M ≤ R, K] · W [N, K]ᵀ -> float32 Y [M, N]: products and sums in float32 on the CUDA cores,
    BN weight rows a program over all of K, every row of x on the same weight loads (R: M rounded up
    to a power of two)."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    rr = tl.arange(0, R)
    n_ok = rn < N
    w_rows = W + rn.to(tl.int64)[:, None] * stride_w
    w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0).to(tl.float32)
    wait_then_release(PDL)      # the weights are no earlier kernel's output: loaded above, before the wait
    r_ok = rr < M
    acc = tl.zeros((R, BN, BK), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + rk
        k_ok = k < K
        if k0 > 0:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + rr[:, None] * stride_x + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w[None, :, :]
    tl.store(Y + rr[:, None] * stride_y + rn[None, :], tl.sum(acc, 2), mask=r_ok[:, None] & n_ok[None, :])


def rows_config(m: int, n: int, k: int, weight_bytes: int, gemv: bool = False) -> dict:
    """Tiles for [m ≤ 64, k] × [n, k]ᵀ: 16–64-row tiles, 64 columns (32 for a float32 weight, whose
    128-deep block is twice the bytes), K split until the tiles cover every SM twice. `gemv` (float32
    products of at most GEMV_ROWS rows): `gemv_kernel`'s weight rows a program and chunk depth."""
    if gemv:
        return dict(GEMV=True, BN=GEMV_BN, BK=GEMV_BK, num_warps=GEMV_WARPS)
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = (32 if weight_bytes == 4 else 64), 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    n_kb = triton.cdiv(k, bk)
    split = 1
    while split * 2 <= n_kb // 2 and tiles * split < 2 * NUM_SMS_GUESS:
        split *= 2
    return dict(BM=bm, BN=bn, BK=bk, SPLIT_K=split, num_warps=4, num_stages=3)


def rows_linear(x2: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x2 [M, K] · weight [N, K]ᵀ -> float32 [M, N] with float32 products and sums (both operands'
    rows contiguous)."""
    m, k = x2.shape
    n = weight.shape[0]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("rows_linear: the weight's rows must be contiguous")
    widened = x2.dtype == torch.float32 or weight.dtype == torch.float32 or x2.dtype != weight.dtype
    cfg = dict(config or rows_config(m, n, k, weight.element_size(), gemv=widened and m <= GEMV_ROWS))
    y = torch.empty(m, n, dtype=torch.float32, device=x2.device)
    if m == 0:
        return y
    if cfg.pop("GEMV", False):
        if m > GEMV_ROWS:
            raise ValueError(f"rows_linear: the GEMV takes at most {GEMV_ROWS} rows, not {m}")
        gemv_kernel[(triton.cdiv(n, cfg["BN"]),)](x2, weight, y, m, n, k, x2.stride(0), weight.stride(0),
                                                 y.stride(0), R=triton.next_power_of_2(m), **cfg, **triton_args(x2))
        return y
    split = cfg.pop("SPLIT_K")
    tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else y
    counters = _arrivals(x2.device, tiles) if split > 1 else y
    # bf16 × bf16 on the tensor cores; the interpreter's bf16 dots are not usable, and a float32
    # operand must not be rounded to tf32
    ieee = interpreting() or widened
    rows_gemm_kernel[(tiles, split)](x2, weight, y, partials, counters, m, n, k, x2.stride(0), weight.stride(0),
                                     y.stride(0), SPLIT_K=split, IEEE=ieee, FENCE=not interpreting(), **cfg,
                                     **triton_args(x2))
    return y
