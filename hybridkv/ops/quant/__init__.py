"""FP8/FP4 quantisation as the V4 references simulate it (`reference`); the FP8 round trip with
power-of-two scales and the FP4 round trip run as one Triton kernel each on CUDA tensors that need
no gradient."""

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.quant import reference
from hybridkv.ops.quant.reference import (  # noqa: F401
    E2M1_VALUES,
    FP4_AMAX_FLOOR,
    FP8_AMAX_FLOOR,
    dequant_fp4_weight,
    dequant_fp8_weight,
    e2m1_magnitude,
    e2m1_round,
    pack_fp4,
    pow2_scale,
    quant_fp4,
    quant_fp8_weight,
    unpack_fp4,
)


def fp8_round_trip(x: torch.Tensor, block: int, pow2: bool = True) -> torch.Tensor:
    """Quantise blocks of the last dim to e4m3 and back; returns x's dtype (see `reference`)."""
    if (use_triton(x) and not x.requires_grad and block & (block - 1) == 0 and x.numel()
            and x.shape[-1] % block == 0
            and x.dtype in ((torch.float32, torch.bfloat16, torch.float16) if pow2 else (torch.float32, torch.bfloat16))):
        from hybridkv.ops.quant import triton as kernels
        return kernels.fp8_round_trip(x, block, pow2)
    return reference.fp8_round_trip(x, block, pow2)


def fp4_round_trip(x: torch.Tensor, block: int = 32, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """Quantise blocks of the last dim to E2M1 with power-of-two ("ue8m0") or e4m3 scales and back;
    returns x's dtype (see `reference`)."""
    if (use_triton(x) and not x.requires_grad and block & (block - 1) == 0 and x.numel()
            and x.shape[-1] % block == 0 and scale_fmt in ("ue8m0", "e4m3")
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        from hybridkv.ops.quant import triton as kernels
        return kernels.fp4_round_trip(x, block, scale_fmt)
    return reference.fp4_round_trip(x, block, scale_fmt)


def act_quant_sim(x: torch.Tensor, block: int) -> torch.Tensor:
    """The activation quantisation before an FP8/FP4 GEMM (per `block` inputs, power-of-two scales)."""
    return fp8_round_trip(x, block, pow2=True)
