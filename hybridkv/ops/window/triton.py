"""Triton kernels of `write_window_fp8`, `write_window_float`, `write_window_v41` and
`window_listing`: one program per token."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX
from hybridkv.ops.quant.triton import _bf16_round, _e4m3_round, _pow2_ceil_exp, fp8_trip_blocks


@triton.jit
def _fp8_blocks(x, inv_scale_max):
    """x [N, 64] -> (e4m3 values / scale, the scales' biased exponents): power-of-two scale per row of 64."""
    amax = tl.maximum(tl.max(tl.abs(x), 1), 1e-4)
    sexp = _pow2_ceil_exp(amax, inv_scale_max)
    scale = (sexp << 23).to(tl.float32, bitcast=True)
    return _e4m3_round(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)), sexp, scale


@triton.jit
def _store_row(dst, codes, rope_bits, sexp, D: tl.constexpr, ROPE: tl.constexpr, BYTES: tl.constexpr):
    """One packed main entry: e4m3 nope codes, bf16 rope dims, ue8m0 scales, zero padding."""
    NOPE: tl.constexpr = D - ROPE
    RAW: tl.constexpr = NOPE + 2 * ROPE + NOPE // 64
    d = tl.arange(0, D)
    tl.store(dst + d, codes, mask=d < NOPE)
    r = d - NOPE
    tl.store(dst + NOPE + 2 * r, (rope_bits & 255).to(tl.uint8), mask=r >= 0)
    tl.store(dst + NOPE + 2 * r + 1, ((rope_bits >> 8) & 255).to(tl.uint8), mask=r >= 0)
    blocks = tl.arange(0, D // 64)
    tl.store(dst + NOPE + 2 * ROPE + blocks, sexp.to(tl.uint8), mask=blocks < NOPE // 64)
    pad = RAW + tl.arange(0, 8)
    tl.store(dst + pad, tl.zeros([8], tl.uint8), mask=pad < BYTES)


@triton.jit
def window_fp8_kernel(KV, s_kv, OUT, RING, s_ring_slot, s_ring_row, SLOTS, POS, W, D: tl.constexpr,
                      ROPE: tl.constexpr, BYTES: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    b = tl.program_id(0)
    d = tl.arange(0, D)
    x = tl.load(KV + b.to(tl.int64) * s_kv + d).to(tl.float32)
    xb = tl.reshape(x, [D // 64, 64])          # the last row of 64 is the rope dims (ROPE = 64)
    q, _, scale = _fp8_blocks(xb, 1.0 / 448.0)
    # the round-tripped values, scaled again from their own maximum as packing does (`pack_main_fp8`)
    q, sexp, _ = _fp8_blocks(q * scale[:, None], 1.0 / 448.0)
    codes = tl.reshape(q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), [D])
    rope_bits = _bf16_round(x).to(tl.int32, bitcast=True) >> 16
    slot = tl.load(SLOTS + b).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    _store_row(OUT + b.to(tl.int64) * BYTES, codes, rope_bits, sexp, D, ROPE, BYTES)
    _store_row(RING + slot * s_ring_slot + (pos % W) * s_ring_row, codes, rope_bits, sexp, D, ROPE, BYTES)


@triton.jit
def window_float_kernel(KV, s_kv, OUT, RING, s_ring_slot, s_ring_row, SLOTS, POS, W, D: tl.constexpr,
                        ROPE: tl.constexpr, BYTES: tl.constexpr, POW2: tl.constexpr, OUT_BF16: tl.constexpr,
                        FLOOR: tl.constexpr, QMAX: tl.constexpr, PDL: tl.constexpr, RING_STORE: tl.constexpr = True):
    """A float store's window row: the nope dims through FP8 and back (blocks of 64, the scale
    `POW2` or plain), the rope dims as they are, in the ring's dtype; rounded to bf16 by hand where
    the rows or the ring are bf16 (the reference's round trip returns the rows' dtype)."""
    wait_then_release(PDL)
    b = tl.program_id(0)
    d = tl.arange(0, D)
    x = tl.reshape(tl.load(KV + b.to(tl.int64) * s_kv + d).to(tl.float32), [D // 64, 64])
    nope = tl.arange(0, D // 64)[:, None] < (D - ROPE) // 64
    y = tl.reshape(tl.where(nope, fp8_trip_blocks(x, FLOOR, QMAX, POW2), x), [D])
    if OUT_BF16:
        y = _bf16_round(y)
    y = y.to(OUT.dtype.element_ty)
    tl.store(OUT + b.to(tl.int64) * D + d, y)
    if RING_STORE:
        slot = tl.load(SLOTS + b).to(tl.int64)
        pos = tl.load(POS + b).to(tl.int64)
        tl.store(RING + slot * s_ring_slot + (pos % W) * s_ring_row + d, y)


def _launch(kernel, name: str, kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
            **constexprs) -> torch.Tensor:
    """One program per token row of kv: its packed row into a new [B, bytes] tensor and into the ring."""
    b, d = kv.shape
    if kv.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError(f"{name}: kv rows and the ring must be contiguous in their last dim")
    if (ring.dtype == torch.uint8) != (kernel is not window_float_kernel):
        raise ValueError(f"{name}: a ring of {ring.dtype}")
    out = torch.empty(b, ring.shape[-1], dtype=ring.dtype, device=kv.device)
    if b:
        kernel[(b,)](kv, kv.stride(0), out, ring, ring.stride(0), ring.stride(1), slots, positions, ring.shape[1], D=d,
                     num_warps=4, **constexprs, **triton_args(kv))
    return out


def write_window_fp8(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     rope_dim: int) -> torch.Tensor:
    return _launch(window_fp8_kernel, "write_window_fp8", kv, ring, slots, positions, ROPE=rope_dim,
                   BYTES=ring.shape[-1])


def write_window_float(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       rope_dim: int, pow2: bool) -> torch.Tensor:
    return _launch(window_float_kernel, "write_window_float", kv, ring, slots, positions, ROPE=rope_dim,
                   BYTES=ring.shape[-1], POW2=pow2,
                   OUT_BF16=torch.bfloat16 in (ring.dtype, kv.dtype), FLOOR=FP8_AMAX_FLOOR,
                   QMAX=FP8_MAX)


def round_trip_rows(kv: torch.Tensor, rope_dim: int, pow2: bool) -> torch.Tensor:
    """`write_window_float`'s rows in kv's own dtype, stored nowhere else."""
    b, d = kv.shape
    out = torch.empty_like(kv, memory_format=torch.contiguous_format)
    if b:
        window_float_kernel[(b,)](kv, kv.stride(0), out, kv, 0, 0, kv, kv, 1, D=d, ROPE=rope_dim, BYTES=d, POW2=pow2,
                                  OUT_BF16=kv.dtype == torch.bfloat16, FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX,
                                  RING_STORE=False, num_warps=4, **triton_args(kv))
    return out


@triton.jit
def _store_v41_row(dst, codes, sexp, D: tl.constexpr, T: tl.constexpr):
    tl.store(dst + tl.arange(0, D), codes)
    tl.store(dst + D + tl.arange(0, D // T), sexp.to(tl.uint8))


@triton.jit
def window_v41_kernel(KV, s_kv, OUT, RING, s_ring_slot, s_ring_row, SLOTS, POS, W, D: tl.constexpr,
                      T: tl.constexpr, PDL: tl.constexpr):
    """V4.1's window row [e4m3 codes: D][ue8m0 scale per T: D/T]: the FP8 round trip in blocks of T,
    then the packing's own scales from the round-tripped values (`pack_v41_window`)."""
    wait_then_release(PDL)
    b = tl.program_id(0)
    x = tl.reshape(tl.load(KV + b.to(tl.int64) * s_kv + tl.arange(0, D)).to(tl.float32), [D // T, T])
    q, _, scale = _fp8_blocks(x, 1.0 / 448.0)
    q, sexp, _ = _fp8_blocks(q * scale[:, None], 1.0 / 448.0)
    # magnitude bits and x's sign apart: a value that rounds to zero keeps its sign (−0 is 0x80, as
    # torch converts it)
    mag = tl.abs(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    codes = tl.reshape(mag | ((x.to(tl.int32, bitcast=True) < 0).to(tl.uint8) << 7), [D])
    slot = tl.load(SLOTS + b).to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    _store_v41_row(OUT + b.to(tl.int64) * (D + D // T), codes, sexp, D, T)
    _store_v41_row(RING + slot * s_ring_slot + (pos % W) * s_ring_row, codes, sexp, D, T)


def write_window_v41(kv: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     tile: int) -> torch.Tensor:
    return _launch(window_v41_kernel, "write_window_v41", kv, ring, slots, positions, T=tile)


@triton.jit
def window_listing_kernel(POS, START, LISTED, VALID, W, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    b = tl.program_id(0)
    pos = tl.load(POS + b).to(tl.int64)
    first = tl.maximum(tl.load(START + b).to(tl.int64), 0)
    i = tl.arange(0, BLOCK)
    at = tl.maximum(pos - W + 1, 0) + i
    ok = i < W
    tl.store(LISTED + b.to(tl.int64) * W + i, at % W, mask=ok)
    tl.store(VALID + b.to(tl.int64) * W + i, ((at >= first) & (at <= pos)).to(tl.uint8), mask=ok)


def window_listing(positions: torch.Tensor, window: int, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b = positions.shape[0]
    positions, start = positions.contiguous(), start.contiguous()
    listed = torch.empty(b, window, dtype=torch.long, device=positions.device)
    valid = torch.empty(b, window, dtype=torch.bool, device=positions.device)
    if b:
        window_listing_kernel[(b,)](positions, start, listed, valid.view(torch.uint8), window,
                                    BLOCK=triton.next_power_of_2(window), num_warps=1, **triton_args(positions))
    return listed, valid
