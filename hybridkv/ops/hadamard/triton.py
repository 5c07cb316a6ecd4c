"""Triton kernel of `rope_hadamard_fp4`: the indexer's query heads rotated (RoPE on their last
dims, in the heads' dtype), Hadamard-transformed (a float32 product with the ±1 matrix, scaled by
d^-1/2, in the heads' dtype) and round-tripped through FP4 (E2M1 in blocks of 32, power-of-two
scales), 16 heads per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.compress.triton import _bf16_round, _e2m1_round, _pow2_ceil_exp
from hybridkv.ops.hadamard.reference import hadamard_matrix

ROWS = 16


@triton.jit
def rope_hadamard_fp4_kernel(X, F, HAD, Y, n_rows, M, stride_xt, stride_xm, f_stride, had_scale, D: tl.constexpr,
                             RD: tl.constexpr, OUT_BF16: tl.constexpr, PREC: tl.constexpr, BM: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    ok = rows < n_rows
    t, m = (rows // M).to(tl.int64), (rows % M).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(X + (t * stride_xt + m * stride_xm)[:, None] + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    # RoPE on the last RD dims, adjacent pairs (the first D − RD pass through: cos 1, sin 0)
    pair = tl.arange(0, D // 2)
    ridx = pair - (D - RD) // 2
    rmask = (ridx >= 0)[None, :] & ok[:, None]
    cos = tl.load(F + t[:, None] * f_stride + 2 * ridx[None, :], mask=rmask, other=1.0)
    sin = tl.load(F + t[:, None] * f_stride + 2 * ridx[None, :] + 1, mask=rmask, other=0.0)
    a, b = tl.split(tl.reshape(x, [BM, D // 2, 2]))
    x = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [BM, D])
    if OUT_BF16:
        x = _bf16_round(x)
    x = tl.dot(x, tl.load(HAD + d[:, None] * D + d[None, :]), input_precision=PREC) * had_scale
    if OUT_BF16:
        x = _bf16_round(x)
    xb = tl.reshape(x, [BM, D // 32, 32])
    amax = tl.maximum(tl.max(tl.abs(xb), 2), 6.0 * 1.1754943508222875e-38)
    scale = (_pow2_ceil_exp(amax, 1.0 / 6.0) << 23).to(tl.float32, bitcast=True)
    q = _e2m1_round(tl.minimum(tl.maximum(xb / scale[:, :, None], -6.0), 6.0)) * scale[:, :, None]
    tl.store(Y + rows.to(tl.int64)[:, None] * D + d[None, :], tl.reshape(q, [BM, D]).to(Y.dtype.element_ty),
             mask=ok[:, None])


def rope_hadamard_fp4(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] (float32 or bf16), freqs complex [T, rd/2] -> [T, heads, d] in x's dtype."""
    t, m, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = torch.view_as_real(freqs)
    if f.stride(-1) != 1 or f.stride(-2) != 2:
        f = f.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = t * m
    if n:
        rope_hadamard_fp4_kernel[(triton.cdiv(n, ROWS),)](
            x, f, hadamard_matrix(d, x.device), y, n, m, x.stride(0), x.stride(1), f.stride(0), d ** -0.5, D=d,
            RD=2 * freqs.shape[-1], OUT_BF16=x.dtype == torch.bfloat16, PREC="ieee", BM=ROWS, num_warps=4)
    return y
