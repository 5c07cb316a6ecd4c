"""Routed experts' packed FP4 weights widened to bf16, a few experts at a time, for prefill.

Prefill-sized MoE launches are compute-bound; Hopper has no FP4 tensor cores, and the grouped FP4
kernel's scaled dot (widening inside the K loop) reaches about a fifth of the bf16 MMA rate. So
prefill widens the experts that have tokens into a bf16 scratch (each E2M1 code times its e8m0
scale is exact in bf16), a bounded number at a time, and multiplies with torch's grouped GEMM
(`torch._grouped_mm`). The widened copy is transient and bounded by `scratch_bytes`: no dense copy
of the experts outlives the launch that needs it.

`widen_experts`: one launch writes [G, N, K] bf16 for G chosen experts of a stacked projection
(uint8 codes [E, N, K/2], low nibble the even input, and e8m0 scales [E, N, K/32]); with a second
projection of the same shape (w3 beside w1) it writes [G, 2N, K], the first's rows then the
second's, so that one grouped GEMM gives gate and up side by side.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.qgemm.layout import FP4_BLOCK, _e8m0
from hybridkv.ops.qgemm.triton import _e2m1

BLOCK_BYTES = 128       # packed bytes (256 inputs) a program widens per row


@triton.jit
def widen_kernel(W, S, W2, S2, IDS, OUT32, N, KB, ew_stride, es_stride,
                 TWO: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, SB: tl.constexpr):
    """OUT32[g, n, j] = the bf16 pair (even input in the low half) of packed byte j of row n of
    expert IDS[g]; rows N..2N from W2/S2 when TWO (BN divides N, so a program reads one of them).
    SB packed bytes share a scale. Each code pair leaves as one int32: no shuffle, one wide store."""
    g = tl.program_id(2)
    e = tl.load(IDS + g).to(tl.int64)
    first = tl.program_id(0) * BN
    w, s = W, S
    if TWO:
        if first >= N:
            w, s = W2, S2
    rn = first + tl.arange(0, BN)
    src_n = tl.where(rn >= N, rn - N, rn).to(tl.int64)
    rb = tl.program_id(1) * BB + tl.arange(0, BB)
    ok = (src_n < N)[:, None] & (rb < KB)[None, :]
    b = tl.load(w + e * ew_stride + src_n[:, None] * KB + rb[None, :], mask=ok, other=0).to(tl.int32) & 255
    sc = tl.load(s + e * es_stride + src_n[:, None] * (KB // SB) + (rb // SB)[None, :], mask=ok, other=127)
    scale = _e8m0(sc)
    lo = (_e2m1(b & 15) * scale).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (_e2m1(b >> 4) * scale).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
    rows = (TWO + 1) * N
    dst = OUT32 + (g.to(tl.int64) * rows + rn.to(tl.int64)[:, None]) * KB + rb[None, :]
    tl.store(dst, lo | (hi << 16), mask=ok)


def widen_experts(codes: torch.Tensor, scales: torch.Tensor, experts: torch.Tensor, out: torch.Tensor | None = None,
                  second: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Stacked packed experts (uint8 codes [E, N, K/2], e8m0 bytes [E, N, K/32], any stride between
    experts, rows contiguous) and expert ids [G] (int32/int64, on the device) -> bf16 [G, N, K], or
    [G, 2N, K] with `second` (another projection's (codes, scales), same shape and strides) below
    the first. `out`: a buffer to write into (at least that many elements; its first ones are used)."""
    e_all, n, kb = codes.shape
    if scales.shape != (e_all, n, kb * 2 // FP4_BLOCK) or codes.stride(1) != kb or codes.stride(2) != 1 \
            or scales.stride(1) != kb * 2 // FP4_BLOCK or scales.stride(2) != 1:
        raise ValueError(f"widen_experts: codes {tuple(codes.shape)} / scales {tuple(scales.shape)} are not "
                         "stacked experts with contiguous rows")
    if second is not None and (second[0].shape != codes.shape or second[0].stride() != codes.stride()
                               or second[1].shape != scales.shape or second[1].stride() != scales.stride()):
        raise ValueError("widen_experts: the second projection must have the first's shape and strides")
    g = experts.numel()
    rows = n * (2 if second is not None else 1)
    need = g * rows * kb * 2
    if out is None:
        out = torch.empty(need, dtype=torch.bfloat16, device=codes.device)
    if out.dtype != torch.bfloat16 or out.numel() < need or not out.is_contiguous():
        raise ValueError(f"widen_experts: the buffer must be contiguous bf16 of at least {need} elements")
    y = out.reshape(-1)[:need].view(g, rows, kb * 2)
    if g == 0:
        return y
    w2, s2 = second if second is not None else (codes, scales)
    bn = min(32, n & -n)                 # the largest power of two (up to 32) dividing N
    grid = (rows // bn, triton.cdiv(kb, BLOCK_BYTES), g)
    widen_kernel[grid](codes, scales, w2, s2, experts, y.view(torch.int32), n, kb, codes.stride(0), scales.stride(0),
                       TWO=second is not None, BN=bn, BB=BLOCK_BYTES, SB=FP4_BLOCK // 2)
    return y
