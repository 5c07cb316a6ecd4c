"""FP8 (e4m3) and FP4 (e2m1) quantisation as the V4 and V4.1 references simulate it.

Scales are powers of two, `2^ceil(log2(amax / qmax))`, computed from the float32 bits exactly as
the reference kernels do; amax is clamped below at 1e-4 (FP8) and 6·2^-126 (FP4). V4.1's global KV
is the exception: FP4 in blocks of 16 with e4m3 scales, `e4m3(amax / 6)` with amax clamped below at
6·2^-9 (the smallest e4m3 subnormal times 6). Values round to nearest, ties to even. A "round
trip" quantises and dequantises in place of storing the low precision value, so that stored and
simulated numbers are identical.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
# E2M1 code -> value for codes 0..7 (bit 3 is the sign).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """2^ceil(log2(amax * (1/qmax))) in float32, bit-exact with the reference's integer trick: the
    mantissa bits, if any is set, carry into the exponent and are then cleared. For normal floats,
    amax/qmax ≥ 2^-126, which the callers' amax floors ensure (FP4's floor gives exactly 2^-126)."""
    x = amax.float() * (1.0 / qmax)     # the scalar is rounded to float32 as the reference's constant is
    return ((x.view(torch.int32) + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"last dimension {n} is not a multiple of the quantisation block {block}")
    return x.reshape(*x.shape[:-1], n // block, block)


def fp8_round_trip(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """Quantise blocks of the last dim to e4m3 and back; returns x's dtype."""
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=FP8_AMAX_FLOOR)
    s = pow2_scale(amax, FP8_MAX) if pow2 else amax / FP8_MAX
    q = (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s
    return q.reshape(x.shape).to(x.dtype)


def act_quant_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """The activation quantisation before an FP8/FP4 GEMM (per `block` inputs, power-of-two scales)."""
    return fp8_round_trip(x, block, pow2=True)


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-6, 6] to the nearest E2M1 value, ties to even mantissa."""
    a = v.abs()
    q = torch.where(a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q.clamp(max=FP4_MAX), v)


def quant_fp4(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 values (as float32 on the E2M1 grid) and their scales per block (float32): powers of two
    ("ue8m0") or e4m3 values ("e4m3")."""
    xb = _blocks(x.float(), block)
    amax = xb.abs().amax(-1, keepdim=True)
    if scale_fmt == "e4m3":
        s = (amax.clamp(min=FP4_E4M3_AMAX_FLOOR) / FP4_MAX).to(torch.float8_e4m3fn).float()
    elif scale_fmt == "ue8m0":
        s = pow2_scale(amax.clamp(min=FP4_AMAX_FLOOR), FP4_MAX)
    else:
        raise ValueError(f"unknown FP4 scale format {scale_fmt!r} (ue8m0 or e4m3)")
    q = e2m1_round((xb / s).clamp(-FP4_MAX, FP4_MAX))
    return q.reshape(x.shape), s.squeeze(-1)


def fp4_round_trip(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    q, s = quant_fp4(x, block, scale_fmt)
    out = _blocks(q, block) * s.unsqueeze(-1)
    return out.reshape(x.shape).to(x.dtype)


def e2m1_magnitude(code: torch.Tensor) -> torch.Tensor:
    """3-bit E2M1 magnitude codes -> float32 values (E2M1_VALUES[code]), computed rather than looked
    up: no host constant is moved to the device (a CUDA-graph capture refuses that)."""
    e, m = (code >> 1).float(), (code & 1).float()
    return torch.where(e > 0, torch.exp2(e - 1) * (1 + 0.5 * m), 0.5 * m)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., n/2] (two E2M1 codes per byte, low nibble = even element) -> float32 [..., n]."""
    b = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)
    mag = e2m1_magnitude(codes & 0x7)
    return torch.where(codes >= 8, -mag, mag)


def pack_fp4(values: torch.Tensor, check: bool = True) -> torch.Tensor:
    """Inverse of unpack_fp4 for values already on the E2M1 grid; returns int8 [..., n/2]. `check`:
    off-grid values raise (the host reads the device's answer: callers that rounded the values to
    the grid themselves, every decode step, pass False)."""
    v = values.float()
    mag = v.abs()
    # 0, 0.5, 1, 1.5 -> 0..3; 2, 3 -> 4, 5; 4, 6 -> 6, 7
    code = torch.where(mag < 2, mag * 2, torch.where(mag < 4, mag + 2, mag * 0.5 + 4)).clamp(0, 7).to(torch.int64)
    if check and not torch.equal(e2m1_magnitude(code), mag):
        raise ValueError("pack_fp4: values are not on the E2M1 grid")
    code = code | ((torch.signbit(v) & (mag > 0)).to(torch.int64) << 3)
    pairs = code.reshape(*code.shape[:-1], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    s = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return s[: shape[0], : shape[1]]


def dequant_fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [out, in] with one scale per block -> dense weight (exact in bf16 and fp32)."""
    w = weight.float()
    return (w * _expand_blocks(scale, tuple(w.shape), block)).to(dtype)


def quant_fp8_weight(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense weight -> e4m3 weight and e8m0 block scales (power of two), the release's layout."""
    out_f, in_f = w.shape
    nb0, nb1 = -(-out_f // block[0]), -(-in_f // block[1])
    pad = torch.zeros(nb0 * block[0], nb1 * block[1], dtype=torch.float32, device=w.device)
    pad[:out_f, :in_f] = w.float()
    tiles = pad.reshape(nb0, block[0], nb1, block[1])
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=FP8_AMAX_FLOOR)
    s = pow2_scale(amax, FP8_MAX)
    q = (w.float() / _expand_blocks(s, (out_f, in_f), block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, s.to(torch.float8_e8m0fnu)


def dequant_fp4_weight(packed: torch.Tensor, scale: torch.Tensor, block: int = 32,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed E2M1 [out, in/2] with one e8m0 scale per `block` inputs -> dense [out, in]."""
    v = unpack_fp4(packed)
    return (v * scale.float().repeat_interleave(block, -1)[..., : v.shape[-1]]).to(dtype)
