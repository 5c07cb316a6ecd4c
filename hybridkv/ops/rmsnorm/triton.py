"""Triton RMS norm: one program per row, the row held in registers (rows up to 16K values): sum of
squares in float32, then x · rsqrt(mean + eps) and the weight, rounded as the reference rounds
(the product, then the weighted product, each in float32). `rms_norm_rope`: the norm and then the
rotary embedding of the row's last values in one launch (a decode step's query heads and its KV
row), the bits of the two launches it replaces."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.rope.triton import launch_views

MAX_ROW = 16384


@triton.jit
def rms_norm_kernel(X, W, Y, D, stride_x, eps, HAS_W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(X + r * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    if HAS_W:
        y = tl.load(W + c, mask=ok, other=0.0) * y
    tl.store(Y + r * D + c, y.to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    if d > MAX_ROW:
        raise ValueError(f"rms_norm kernel: rows of {d} values exceed {MAX_ROW}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        rms_norm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, d, x2.stride(0), float(eps),
                                        HAS_W=weight is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
                                        **triton_args(x2))
    return y.view(x.shape)


@triton.jit
def rms_norm_rope_kernel(X, W, F, Y, M, D, RD, stride_xt, stride_xm, f_stride, eps, HAS_W: tl.constexpr,
                         BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """Row (t, m) of X [T, M, D]: `rms_norm_kernel`'s row (the same loads and sum, so the same
    bits), rounded to Y's dtype, and then its last RD values rotated in adjacent pairs by row t's
    (cos, sin) as `rope.triton.rope_kernel` rotates what it reads back (pairs re-read, normalised
    again elementwise: the same values as the stored ones, in registers)."""
    wait_then_release(PDL)
    row = tl.program_id(0).to(tl.int64)
    t, m = row // M, row % M
    src = X + t * stride_xt + m * stride_xm
    dst = Y + row * D
    c = tl.arange(0, BLOCK)
    ok = c < D
    x = tl.load(src + c, mask=ok, other=0.0).to(tl.float32)
    rs = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = x * rs
    if HAS_W:
        y = tl.load(W + c, mask=ok, other=0.0) * y
    keep = c < D - RD
    tl.store(dst + c, y.to(Y.dtype.element_ty), mask=keep)
    j = tl.arange(0, BLOCK_R)
    rok = j < RD // 2
    i0 = D - RD + 2 * j
    x0 = tl.load(src + i0, mask=rok, other=0.0).to(tl.float32) * rs
    x1 = tl.load(src + i0 + 1, mask=rok, other=0.0).to(tl.float32) * rs
    if HAS_W:
        x0 = tl.load(W + i0, mask=rok, other=0.0) * x0
        x1 = tl.load(W + i0 + 1, mask=rok, other=0.0) * x1
    x0 = x0.to(Y.dtype.element_ty).to(tl.float32)
    x1 = x1.to(Y.dtype.element_ty).to(tl.float32)
    cos = tl.load(F + t * f_stride + 2 * j, mask=rok, other=1.0)
    sin = tl.load(F + t * f_stride + 2 * j + 1, mask=rok, other=0.0)
    tl.store(dst + i0, (x0 * cos - x1 * sin).to(Y.dtype.element_ty), mask=rok)
    tl.store(dst + i0 + 1, (x0 * sin + x1 * cos).to(Y.dtype.element_ty), mask=rok)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, freqs: torch.Tensor,
                  in_place: bool = False) -> torch.Tensor:
    """x [T, ..., D] (rows of D contiguous values; the leading dims may be strided), freqs complex
    [T (or 1), rd/2]: `rope.apply_rope(rms_norm(x, weight, eps), freqs)` in one launch. `in_place` (x
    contiguous): written over x, returned (a program reads its row before it writes it)."""
    d, t = x.shape[-1], x.shape[0]
    rd = freqs.shape[-1] * 2
    if d > MAX_ROW or rd > d or freqs.dim() != 2 or freqs.shape[0] not in (1, t):
        raise ValueError(f"rms_norm_rope kernel: rows of {d} values (at most {MAX_ROW}), {rd} rotated, "
                         f"{freqs.shape[0]} rotations for {t} tokens")
    x3, y, f, f_stride = launch_views(x, freqs, in_place, "rms_norm_rope")
    m = x3.shape[1]
    if t * m:
        block = triton.next_power_of_2(d)
        rms_norm_rope_kernel[(t * m,)](x3, weight if weight is not None else x3, f, y, m, d, rd, x3.stride(0),
                                       x3.stride(1), f_stride, float(eps), HAS_W=weight is not None, BLOCK=block,
                                       BLOCK_R=triton.next_power_of_2(max(rd // 2, 1)),
                                       num_warps=4 if block <= 2048 else 8, **triton_args(x3))
    return y
