"""Triton kernel of `rope_hadamard_fp4` and `rope_fp4`: heads rotated (RoPE on their last dims, in
the heads' dtype), optionally Hadamard-transformed (a float32 product with the ±1 matrix, scaled by
d^-1/2, in the heads' dtype: V4's indexer queries), and round-tripped through FP4 (E2M1 in blocks of
32 with power-of-two scales, or of 16 with e4m3 scales: V4.1's global KV), ROWS heads per program.
The Hadamard product runs as butterflies in registers (31 registers per thread for sm_90, nothing
spilled): a float32 product with the 128 × 128 matrix loaded per program spilled 6.5 KB per thread
and took 79 µs a launch for one token's 64 heads on the H200."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.triton import _bf16_round, fp4_blocks

ROWS = 4


@triton.jit
def _walsh_hadamard(x, BM: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """x [BM, D] times the unscaled Sylvester-order ±1 matrix, as log2(D) butterfly stages in
    registers ((a, b) -> (a + b, a − b) over pairs h apart): no D × D matrix to hold, no MMA."""
    for s in tl.static_range(LOG2_D):
        y = tl.permute(tl.reshape(x, [BM, D >> (s + 1), 2, 1 << s]), [0, 1, 3, 2])
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [BM, D])
    return x


@triton.jit
def rope_fp4_kernel(X, F, Y, n_rows, M, stride_xt, stride_xm, f_stride, had_scale, D: tl.constexpr,
                    RD: tl.constexpr, OUT_BF16: tl.constexpr, BM: tl.constexpr, HADAMARD: tl.constexpr,
                    LOG2_D: tl.constexpr, QBLOCK: tl.constexpr, E4M3: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
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
    if HADAMARD:
        x = _walsh_hadamard(x, BM, D, LOG2_D) * had_scale
        if OUT_BF16:
            x = _bf16_round(x)
    q = fp4_blocks(tl.reshape(x, [BM * (D // QBLOCK), QBLOCK]), E4M3)
    tl.store(Y + rows.to(tl.int64)[:, None] * D + d[None, :], tl.reshape(q, [BM, D]).to(Y.dtype.element_ty),
             mask=ok[:, None])


def rope_fp4(x: torch.Tensor, freqs: torch.Tensor, hadamard: bool, block: int = 32, e4m3: bool = False) -> torch.Tensor:
    """x [T, heads, d] (float32 or bf16), freqs complex [T, rd/2] -> [T, heads, d] in x's dtype:
    RoPE, the Hadamard rotation where `hadamard`, then FP4 in blocks of `block` (e4m3 scales where
    `e4m3`, else powers of two)."""
    t, m, d = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    f = torch.view_as_real(freqs)
    if f.stride(-1) != 1 or f.stride(-2) != 2:
        f = f.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = t * m
    if n:
        rope_fp4_kernel[(triton.cdiv(n, ROWS),)](
            x, f, y, n, m, x.stride(0), x.stride(1), f.stride(0), d ** -0.5, D=d, RD=2 * freqs.shape[-1],
            OUT_BF16=x.dtype == torch.bfloat16, BM=ROWS, HADAMARD=hadamard, LOG2_D=d.bit_length() - 1, QBLOCK=block,
            E4M3=e4m3, num_warps=4, **triton_args(x))
    return y


def rope_hadamard_fp4(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] (float32 or bf16), freqs complex [T, rd/2] -> [T, heads, d] in x's dtype."""
    return rope_fp4(x, freqs, hadamard=True)
