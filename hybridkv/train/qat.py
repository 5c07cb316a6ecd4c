"""Quantisation-aware training: fake quantisation with a straight-through gradient.

Each function's forward value is bit-identical to the inference numerics of `hybridkv.ops.quant`
(the FP4 expert weights as stored and dequantised, the FP8 activation quantisation before a quantised
GEMM, the FP8/FP4 round trips of the KV and indexer paths); its backward pass is the identity. The
STE is an autograd function returning fn(x) itself rather than `x + (fn(x) − x).detach()`, whose
floating-point sum can differ from fn(x) (signed zeros) and which keeps an extra tensor alive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridkv.model.linear import FP4_WEIGHT_BLOCK
from hybridkv.ops.quant import act_quant_sim, fp4_round_trip, fp8_round_trip, pack_fp4, quant_fp4


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def ste(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """fn(x) in the forward pass, identity gradient in the backward pass (fn must keep shape and dtype)."""
    return _StraightThrough.apply(x, fn)


def _fp4_weight_values(w: torch.Tensor) -> torch.Tensor:
    """What `dequant_fp4_weight` returns for the export of `w`: E2M1 values times their block's
    power-of-two scale; zeros are +0 because the packed format has no negative zero."""
    q, s = quant_fp4(w, FP4_WEIGHT_BLOCK, "ue8m0")
    q = torch.where(q == 0, torch.zeros_like(q), q)
    v = q.reshape(*w.shape[:-1], -1, FP4_WEIGHT_BLOCK) * s.unsqueeze(-1)
    return v.reshape(w.shape).to(w.dtype)


def fp4_weight_fake(w: torch.Tensor) -> torch.Tensor:
    """An FP4 expert weight [..., out, in] as inference sees it after export (E2M1, blocks of 32 inputs,
    e8m0 scales), with a straight-through gradient to the float master weight."""
    return ste(w, _fp4_weight_values)


def quantize_fp4_weight_for_export(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [..., out, in] -> (packed E2M1 int8 [..., out, in/2], e8m0 scale [..., out, in/32]),
    the layout of an "fp4" `Linear`; `dequant_fp4_weight` of it equals `fp4_weight_fake(w)` bit for bit."""
    q, s = quant_fp4(w.detach(), FP4_WEIGHT_BLOCK, "ue8m0")
    return pack_fp4(q), s.to(torch.float8_e8m0fnu)


def fp8_act_fake(x: torch.Tensor, block: int) -> torch.Tensor:
    """`act_quant_sim` (e4m3 per `block` inputs, power-of-two scales) with a straight-through gradient."""
    return ste(x, lambda t: act_quant_sim(t, block))


def fp8_round_trip_ste(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """`fp8_round_trip` with a straight-through gradient."""
    return ste(x, lambda t: fp8_round_trip(t, block, pow2))


def fp4_round_trip_ste(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """`fp4_round_trip` (ue8m0 or, for V4.1's global KV, e4m3 scales) with a straight-through gradient."""
    return ste(x, lambda t: fp4_round_trip(t, block, scale_fmt))
