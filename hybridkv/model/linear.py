"""Linear layers in the release's weight formats.

- "float": a dense weight [out, in] in the model's float dtype.
- "fp8":   e4m3 weight [out, in] + e8m0 scale per (block_out × block_in) tile; the input is
           quantised to e4m3 per `block_in` values with power-of-two scales before the GEMM.
- "fp4":   E2M1 pairs packed in int8 [out, in/2] (low nibble = even element) + e8m0 scale per 32
           inputs; the input is FP8-quantised per `act_block` values as for fp8.
On CUDA, FP8 weights with 128×128 blocks run through GEMMs that read the e4m3 weight itself
(`hybridkv.ops.qgemm`: a Triton kernel for decode, torch's block-scaled matmul for prefill) and FP4 experts through the MoE's grouped kernels: no dense copy is
made. Elsewhere (the CPU, other block sizes, `HYBRIDKV_DENSE_WEIGHTS=1`) the weight is dequantised
(exactly) once and cached; the activation quantisation is applied all the same, so the numerics
equal the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.ops.backend import is_deterministic
from hybridkv.ops.qgemm import fp8_kernel_ok, packed_fp8_linear
from hybridkv.ops.quant import act_quant_sim, dequant_fp4_weight, dequant_fp8_weight

FORMATS = ("float", "fp8", "fp4")
FP4_WEIGHT_BLOCK = 32


def widened_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x · weightᵀ with float32 products and sums, in out_dtype, for a weight stored narrower than
    the arithmetic (a float32 weight the checkpoint holds in bf16: the head, the compressors'
    projections). On CUDA with x in the weight's dtype that is one GEMM with a float32 output:
    bf16 × bf16 products are exact in float32, so it computes what widening both operands would,
    without a float32 copy of the weight at every step. Elsewhere (and in deterministic mode, whose
    GEMMs are batch-invariant) both are widened."""
    if (x.is_cuda and x.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)
            and not is_deterministic() and not torch.is_grad_enabled()):
        y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    else:
        y = F.linear(x.to(torch.float32), weight.to(torch.float32))
    return y if y.dtype == out_dtype else y.to(out_dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str = "float", dtype: torch.dtype = torch.float32,
                 block: tuple[int, int] = (128, 128)):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.in_features, self.out_features, self.fmt, self.block = in_features, out_features, fmt, tuple(block)
        self.compute_dtype = dtype
        if fmt == "float":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        elif fmt == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            sb = (-(-out_features // block[0]), -(-in_features // block[1]))
            self.scale = nn.Parameter(torch.empty(sb, dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // FP4_WEIGHT_BLOCK,
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        self._dense: tuple[tuple, torch.Tensor] | None = None

    @property
    def act_block(self) -> int:
        return self.block[1]

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of the compute dtype (cached for quantised formats)."""
        if self.fmt == "float":
            return self.weight
        key = (self.weight.data_ptr(), self.weight._version, self.scale._version, self.weight.device)
        if self._dense is None or self._dense[0] != key:
            if self.fmt == "fp8":
                w = dequant_fp8_weight(self.weight, self.scale, self.block, self.compute_dtype)
            else:
                w = dequant_fp4_weight(self.weight, self.scale, FP4_WEIGHT_BLOCK, self.compute_dtype)
            self._dense = (key, w)
        return self._dense[1]

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the GEMM reads it: FP8-quantised per `act_block` inputs for the quantised formats, in
        the weight's dtype."""
        if self.fmt == "float":
            return x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)
        x = act_quant_sim(x, self.act_block)
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt == "float" and self.weight.dtype != self.compute_dtype:
            return widened_linear(x, self.weight, self.compute_dtype)
        if self.fmt == "fp8" and fp8_kernel_ok(x, self.weight, self.block):
            return packed_fp8_linear(x, self.weight, self.scale, self.compute_dtype)
        y = F.linear(self.prepare_input(x), self.dense_weight())
        return y if y.dtype == self.compute_dtype else y.to(self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"
