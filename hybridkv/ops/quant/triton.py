"""One Triton kernel for the FP8 (e4m3) round trip with power-of-two block scales, the activation
quantisation in front of every FP8 linear and the window KV's storage round trip (with plain amax/448
scales too, as a checkpoint without scale_fmt ue8m0 round-trips its KV); one for the FP4
(E2M1) round trip with power-of-two or e4m3 block scales (V4.1's indexer queries and keys, its global
KV). The plain-torch definitions (`reference.fp8_round_trip`, `reference.fp4_round_trip`) take a
dozen launches per call; on a decode step, where every call is a few thousand elements, those
launches were the host's largest cost.

Bit-exact with the reference: the scale 2^ceil(log2(amax/448)) comes from the float32 bits
(adding 0x7FFFFF to a normal float's bits and keeping the exponent rounds it up to a power of
two, leaving powers of two alone), x · 2^-k is exact, and the rounding to e4m3 is to nearest,
ties to even, as torch's conversion. Plain scales amax/448 and x/s are IEEE divisions (`div_rn`), as
torch's are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.reference import FP4_AMAX_FLOOR, FP4_E4M3_AMAX_FLOOR, FP4_MAX, FP8_AMAX_FLOOR, FP8_MAX

ROWS = 16   # quantisation blocks per program
# the FP4 kernel reads these as constexprs (the GPU's compiler refuses plain globals)
_FP4_FLOOR = tl.constexpr(FP4_AMAX_FLOOR)
_FP4_E4M3_FLOOR = tl.constexpr(FP4_E4M3_AMAX_FLOOR)
_E2M1_MAX = tl.constexpr(FP4_MAX)
_INV_E2M1_MAX = tl.constexpr(1.0 / FP4_MAX)


@triton.jit
def _e4m3_round(q):
    """|q| ≤ 448 rounded to the nearest e4m3 value, ties to even, as float32. Done in float32
    arithmetic rather than by a conversion to float8 (Triton's interpreter drops the carry into the
    exponent when a mantissa rounds up): adding and subtracting c = 1.5·2^23·quantum rounds to a
    multiple of the quantum 2^(e−3) of q's binade (e ≥ −6: e4m3's subnormals share the quantum 2^−9)."""
    a = tl.abs(q)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, -6)
    c = (((e + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)
    r = (a + c) - c
    return tl.where(q < 0, -r, r)


@triton.jit
def _pow2_ceil_exp(amax, inv_qmax):
    """Biased exponent of 2^ceil(log2(amax * inv_qmax)) (bit-exact with the reference's frexp form)."""
    u = (amax * inv_qmax).to(tl.int32, bitcast=True)
    return ((u >> 23) & 255) + ((u & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def _bf16_round(x):
    """float32 -> nearest bf16 (ties to even), kept as float32 (by hand, as the interpreter truncates)."""
    u = x.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_saturate(t):
    """t ≥ 0 converted to e4m3 as torch converts to float8_e4m3fn: to nearest, ties to even, values
    past 448 saturated to 448."""
    return _e4m3_round(tl.minimum(t, 448.0))


@triton.jit
def _e2m1_round(v):
    a = tl.abs(v)
    y = tl.where(a < 2, a * 2, tl.where(a < 4, a, a * 0.5))
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & ((r.to(tl.int32) % 2) == 1), r - 1, r)
    q = tl.minimum(tl.where(a < 2, r * 0.5, tl.where(a < 4, r, r * 2)), 6.0)
    return tl.where(v < 0, -q, q)


@triton.jit
def _load_blocks(X, n_blocks, BLOCK: tl.constexpr, R: tl.constexpr):
    """This program's R quantisation blocks of BLOCK values as float32 [R, BLOCK], their offsets and mask."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    mask = (rows < n_blocks)[:, None]
    offs = rows.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return tl.load(X + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


@triton.jit
def fp8_trip_blocks(x, FLOOR: tl.constexpr, QMAX: tl.constexpr, POW2: tl.constexpr):
    """x [R, BLOCK] float32, each row one quantisation block, through e4m3 and back (float32): the
    scale a power of two (POW2) or the plain amax / QMAX, divided with correct rounding."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), FLOOR)
    if POW2:
        t = amax * (1.0 / QMAX)
        s_bits = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        s = s_bits.to(tl.float32, bitcast=True)
        inv = (0x7F000000 - s_bits).to(tl.float32, bitcast=True)          # 1/s, exact for a power of two
        q = tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX)
    else:
        s = tl.math.div_rn(amax, QMAX)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -QMAX), QMAX)
    return _e4m3_round(q) * s[:, None]


@triton.jit
def fp8_round_trip_kernel(X, Y, n_blocks, FLOOR: tl.constexpr, QMAX: tl.constexpr, BLOCK: tl.constexpr,
                          R: tl.constexpr, PDL: tl.constexpr, POW2: tl.constexpr = True,
                          OUT_BF16: tl.constexpr = False):
    wait_then_release(PDL)
    x, offs, mask = _load_blocks(X, n_blocks, BLOCK, R)
    y = fp8_trip_blocks(x, FLOOR, QMAX, POW2)
    if OUT_BF16:            # (with a plain scale y has more bits than bf16 holds: rounded by hand)
        y = _bf16_round(y)
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def _round_trip(kernel, x: torch.Tensor, block: int, **constexprs) -> torch.Tensor:
    """A round-trip kernel over x's blocks of `block` values, ROWS blocks per program."""
    xc = x.contiguous()
    y = torch.empty_like(xc)
    n_blocks = xc.numel() // block
    if n_blocks:
        kernel[(triton.cdiv(n_blocks, ROWS),)](xc, y, n_blocks, BLOCK=block, R=ROWS, num_warps=4, **constexprs,
                                               **triton_args(xc))
    return y.view(x.shape)


def fp8_round_trip(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """`reference.fp8_round_trip(x, block, pow2)` in one launch (x's last dim a multiple of block,
    block a power of two)."""
    if not pow2 and x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"fp8 round trip with plain scales: float32 or bfloat16 values, not {x.dtype}")
    return _round_trip(fp8_round_trip_kernel, x, block, FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX, POW2=pow2,
                       OUT_BF16=not pow2 and x.dtype == torch.bfloat16)


@triton.jit
def fp4_blocks(x, E4M3: tl.constexpr):
    """x [R, BLOCK] float32, each row one quantisation block, through E2M1 and back (float32)."""
    amax = tl.max(tl.abs(x), 1)
    if E4M3:    # e4m3(amax / 6), and x / s correctly rounded (s is no power of two)
        s = _e4m3_saturate(tl.math.div_rn(tl.maximum(amax, _FP4_E4M3_FLOOR), _E2M1_MAX))
        q = tl.math.div_rn(x, s[:, None])
    else:       # 2^ceil(log2(amax / 6)); x · (1/s) is exact
        t = tl.maximum(amax, _FP4_FLOOR) * _INV_E2M1_MAX
        s_bits = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
        s = s_bits.to(tl.float32, bitcast=True)
        q = x * (0x7F000000 - s_bits).to(tl.float32, bitcast=True)[:, None]
    return _e2m1_round(tl.minimum(tl.maximum(q, -_E2M1_MAX), _E2M1_MAX)) * s[:, None]


@triton.jit
def fp4_round_trip_kernel(X, Y, n_blocks, BLOCK: tl.constexpr, R: tl.constexpr, E4M3: tl.constexpr,
                          PDL: tl.constexpr):
    wait_then_release(PDL)
    x, offs, mask = _load_blocks(X, n_blocks, BLOCK, R)
    tl.store(Y + offs, fp4_blocks(x, E4M3).to(Y.dtype.element_ty), mask=mask)


def fp4_round_trip(x: torch.Tensor, block: int, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """`reference.fp4_round_trip(x, block, scale_fmt)` in one launch (x's last dim a multiple of
    block, block a power of two)."""
    return _round_trip(fp4_round_trip_kernel, x, block, E4M3=scale_fmt == "e4m3")
