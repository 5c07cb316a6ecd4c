"""Triton rotary embedding: one program per row of x viewed as [T, M, D] (M the heads, or 1),
the first D − rd values copied (or, in place, left alone), the last rd rotated in adjacent pairs
by the row's e^{i·θ} in float32 (real = x₀c − x₁s, imaginary = x₀s + x₁c, the reference's complex
product), in x's dtype. And the rotations themselves (`rope_freqs`): one launch for what the
reference spends four to seven torch operations on (the position arithmetic, the conversion, the
product with the frequencies, the polar form), with the CUDA math library's cosine and sine
(libdevice, as torch's kernels call them: the same bits as torch's rotations on the GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from hybridkv.ops.backend import interpreting
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


def launch_views(x: torch.Tensor, freqs: torch.Tensor, in_place: bool, name: str):
    """What a kernel rotating rows of x [T, ..., D] by freqs complex [T (or 1), rd/2] reads and writes:
    (x as [T, M, D] with contiguous rows, the output (x itself `in_place`, which needs x contiguous),
    the rotations as float32 (cos, sin) pairs, their row stride: 0 where one serves every token)."""
    if in_place and not x.is_contiguous():
        raise ValueError(f"{name} in place needs a contiguous x")
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    y = x if in_place else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    f = torch.view_as_real(freqs.reshape(freqs.shape[0], -1))
    if f.stride(-1) != 1 or f.stride(-2) != 2:
        f = f.contiguous()
    return x3, y, f, f.stride(0) if freqs.shape[0] > 1 else 0


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False, in_place: bool = False) -> torch.Tensor:
    """`reference.apply_rope` in one launch: x [T, ..., D], freqs complex [T (or 1), rd/2]. `in_place`
    (x contiguous): rotate x's last rd values where they are and return x, reading and writing
    only those (a query's 64 rotated values of 512: an eighth of the bytes)."""
    rd = freqs.shape[-1] * 2
    t, d = x.shape[0], x.shape[-1]
    x3, y, f, f_stride = launch_views(x, freqs, in_place, "apply_rope")
    m = x3.shape[1]
    if t * m:
        rope_kernel[(t * m,)](x3, f, y, m, d, rd, x3.stride(0), x3.stride(1), f_stride,
                              INVERSE=inverse, BLOCK=triton.next_power_of_2(max(d - rd, 1)),
                              BLOCK_R=triton.next_power_of_2(max(rd // 2, 1)), IN_PLACE=in_place,
                              num_warps=1 if d <= 256 else 2, **triton_args(x3))
    return y


@triton.jit
def rope_freqs_kernel(POS, INV, OUT, n, offset, lo, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_F: tl.constexpr, CLAMP: tl.constexpr, SPLIT: tl.constexpr, LIBDEVICE: tl.constexpr,
                      PDL: tl.constexpr):
    """Rows t of OUT [n, HALF, 2] = (cos, sin) of float32(max(pos_t + offset, lo)) · inv_freq; with
    SPLIT, OUT is [2, n, HALF]: the cosines, then the sines. LIBDEVICE: libdevice's cosf and sinf
    called by name (the interpreter has none: there tl.cos and tl.sin, computed with numpy)."""
    wait_then_release(PDL)
    f = tl.arange(0, BLOCK_F)
    fok = f < HALF
    inv = tl.load(INV + f, mask=fok, other=0.0)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok = t < n
    p = tl.load(POS + t, mask=tok, other=0).to(tl.int64) + offset
    if CLAMP:
        p = tl.maximum(p, lo)
    a = p.to(tl.float32)[:, None] * inv[None, :]
    if LIBDEVICE:
        c, s = libdevice.cos(a), libdevice.sin(a)
    else:
        c, s = tl.cos(a), tl.sin(a)
    at = t.to(tl.int64)[:, None] * HALF + f[None, :]
    ok = tok[:, None] & fok[None, :]
    if SPLIT:
        tl.store(OUT + at, c, mask=ok)
        tl.store(OUT + n * HALF + at, s, mask=ok)
    else:
        tl.store(OUT + 2 * at, c, mask=ok)
        tl.store(OUT + 2 * at + 1, s, mask=ok)


def rope_freqs(positions: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0,
               clamp_min: int | None = None, split: bool = False):
    """`reference.rope_freqs(max(positions + offset, clamp_min), inv_freq)` in one launch:
    complex64 [len(positions), len(inv_freq)], or with `split` its real and imaginary parts as two
    contiguous float32 tensors."""
    pos = positions.reshape(-1)
    if not pos.is_contiguous():
        pos = pos.contiguous()
    inv = inv_freq.to(device=pos.device, dtype=torch.float32).contiguous()
    half = inv.shape[0]
    n = pos.shape[0]
    if split:
        out = torch.empty(2, n, half, dtype=torch.float32, device=pos.device)
    else:
        out = torch.empty(n, half, dtype=torch.complex64, device=pos.device)
    if n:
        block_f = triton.next_power_of_2(max(half, 1))
        block_t = max(1, min(64, 2048 // block_f))
        rope_freqs_kernel[(triton.cdiv(n, block_t),)](
            pos, inv, out if split else torch.view_as_real(out), n, int(offset), int(clamp_min or 0), HALF=half,
            BLOCK_T=block_t, BLOCK_F=block_f, CLAMP=clamp_min is not None, SPLIT=split, LIBDEVICE=not interpreting(),
            num_warps=1 if block_t * block_f <= 1024 else 4, **triton_args(pos))
    return (out[0], out[1]) if split else out
