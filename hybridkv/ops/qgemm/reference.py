"""GEMMs with the release's packed weights, by their definition: the input FP8-quantised per
`act_block` values with power-of-two scales (`act_quant_sim`), the weight dequantised exactly, one
dense GEMM. This is what `Linear` computes on the CPU; the kernels must equal it within the
accumulation's round-off."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.quant.reference import act_quant_sim, dequant_fp4_weight, dequant_fp8_weight

FP4_WEIGHT_BLOCK = 32


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ (e4m3 weight [N, K] × e8m0 scale per block)ᵀ -> [..., N] of out_dtype."""
    w = dequant_fp8_weight(weight, scale, block, out_dtype)
    return F.linear(act_quant_sim(x, block[1]).to(out_dtype), w).to(out_dtype)


def fp4_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, act_block: int,
               out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ (packed E2M1 [N, K/2] × e8m0 scale per 32 inputs)ᵀ -> [..., N] of out_dtype."""
    w = dequant_fp4_weight(weight, scale, FP4_WEIGHT_BLOCK, out_dtype)
    return F.linear(act_quant_sim(x, act_block).to(out_dtype), w).to(out_dtype)
