"""Triton rotary embedding: one program per row of x viewed as [T, M, D] (M the heads, or 1),
the first D − rd values copied (or, in place, left alone), the last rd rotated in adjacent pairs
by the row's e^{i·θ} in float32 (real = x₀c − x₁s, imaginary = x₀s + x₁c, the reference's complex
product), in x's dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release


@triton.jit
def rope_kernel(X, F, Y, M, D, RD, stride_xt, stride_xm, f_stride, INVERSE: tl.constexpr,
                BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, IN_PLACE: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    t, m = row // M, row % M
    src = X + t * stride_xt + m * stride_xm
    dst = Y + row * D
    if not IN_PLACE:         # in place (Y is X, contiguous) the first D − rd values stay where they are
        c = tl.arange(0, BLOCK)
        keep = c < D - RD
        tl.store(dst + c, tl.load(src + c, mask=keep), mask=keep)
    j = tl.arange(0, BLOCK_R)
    ok = j < RD // 2
    base = D - RD
    x0 = tl.load(src + base + 2 * j, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(src + base + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
    cos = tl.load(F + t * f_stride + 2 * j, mask=ok, other=1.0)
    sin = tl.load(F + t * f_stride + 2 * j + 1, mask=ok, other=0.0)
    if INVERSE:
        sin = -sin
    tl.store(dst + base + 2 * j, (x0 * cos - x1 * sin).to(Y.dtype.element_ty), mask=ok)
    tl.store(dst + base + 2 * j + 1, (x0 * sin + x1 * cos).to(Y.dtype.element_ty), mask=ok)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, in_place: bool = False) -> torch.Tensor:
    """`reference.apply_rope` in one launch: x [T, ..., D], freqs complex [T (or 1), rd/2]. `in_place`
    (x contiguous): rotate x's last rd values where they are and return x, reading and writing
    only those (a query's 64 rotated values of 512: an eighth of the bytes)."""
    rd = freqs.shape[-1] * 2
    t, d = x.shape[0], x.shape[-1]
    if in_place and not x.is_contiguous():
        raise ValueError("apply_rope in place needs a contiguous x")
    x3 = x.reshape(t, -1, d)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    m = x3.shape[1]
    y = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    f = torch.view_as_real(freqs.reshape(freqs.shape[0], -1))
    if f.stride(-1) != 1 or f.stride(-2) != 2:
        f = f.contiguous()
    if t * m:
        rope_kernel[(t * m,)](x3, f, y, m, d, rd, x3.stride(0), x3.stride(1), f.stride(0) if freqs.shape[0] > 1 else 0,
                              INVERSE=inverse, BLOCK=triton.next_power_of_2(max(d - rd, 1)),
                              BLOCK_R=triton.next_power_of_2(max(rd // 2, 1)), IN_PLACE=in_place,
                              num_warps=1 if d <= 256 else 2, **triton_args(x3))
    return y
