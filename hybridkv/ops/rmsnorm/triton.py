"""Triton RMS norm: one program per row, the row held in registers (rows up to 16K values): sum of
squares in float32, then x · rsqrt(mean + eps) and the weight, rounded as the reference rounds
(the product, then the weighted product, each in float32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release

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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, in_place: bool = False) -> torch.Tensor:
    """in_place (x contiguous): the rows written over x (a program reads its whole row first)."""
    d = x.shape[-1]
    if d > MAX_ROW:
        raise ValueError(f"rms_norm kernel: rows of {d} values exceed {MAX_ROW}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = x2 if in_place else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        rms_norm_kernel[(x2.shape[0],)](x2, weight if weight is not None else x2, y, d, x2.stride(0), float(eps),
                                        HAS_W=weight is not None, BLOCK=block, num_warps=4 if block <= 2048 else 8,
                                        **triton_args(x2))
    return y.view(x.shape)
