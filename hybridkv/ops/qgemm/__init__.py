"""Linear layers over the release's packed weights (FP8 e4m3 with e8m0 scales per 128×128 tile in V4's
release, per 32×32 in V4.1's; the experts' FP4 lives in `hybridkv.ops.grouped_moe`). `reference` is
the definition (input FP8 round trip, exact dequantisation, one dense GEMM); on CUDA the Triton
kernel reads the FP8 weight itself. `HYBRIDKV_DENSE_WEIGHTS=1` keeps the old path on CUDA (a dense
copy cached per weight, see `hybridkv.model.linear`), the baseline of the GPU benchmark. On CUDA,
inputs of more than `triton.DECODE_ROWS` rows (prefill) go through torch's block-scaled FP8 matmul
where this torch computes it correctly (`scaled`), at most `fp8_mma.MAX_ROWS` rows through the CUDA
kernel on the FP8 tensor cores (`fp8_mma`, sm_89 and newer), the rows between (and the interpreter)
through the Triton kernel (`triton`); `scaled` is built for 128×128 tiles, `fp8_mma` for 128×128
and 32×32 (the latter opt-in, `fp8_mma.enabled`), so other tiles take the Triton kernel."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import dense_weights, is_deterministic, use_triton
from hybridkv.ops.qgemm import reference  # noqa: F401


def fp8_kernel_ok(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether `fp8_linear` runs the kernel for this input and weight: CUDA, square scale tiles of
    32, 64 or 128 values, K a multiple of the tile, no gradient wanted (the kernel has no
    backward), not forced dense, and not in deterministic mode (whose batch-invariant GEMMs replace
    torch's, and the kernel's split-K depends on the batch)."""
    if (dense_weights() or is_deterministic() or not use_triton(x) or (x.requires_grad and torch.is_grad_enabled())
            or x.dtype not in (torch.float32, torch.bfloat16, torch.float16)):
        return False
    from hybridkv.ops.qgemm import triton as kernels
    return kernels.fp8_supported(weight, block)



def packed_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                      block: int = 128) -> torch.Tensor:
    """The kernel path of `fp8_linear` (for inputs where `fp8_kernel_ok`), the weight's scale tiles
    block×block: few rows take the FP8 tensor-core kernel (`fp8_mma`; at 32, V4.1's tiles, only where
    `fp8_mma.enabled(32)`), many rows at 128 (V4) torch's block-scaled matmul (`scaled`), the rest the
    Triton GEMM."""
    from hybridkv.ops.qgemm import fp8_mma
    from hybridkv.ops.qgemm import triton as kernels
    k = weight.shape[1]
    x2 = x.reshape(-1, k)
    if x.is_cuda and x2.shape[0] <= fp8_mma.MAX_ROWS and fp8_mma.usable(x2, weight, out_dtype, block):
        return fp8_mma.fp8_linear(x2, weight, scale, out_dtype, block=block).view(*x.shape[:-1], weight.shape[0])
    if block == fp8_mma.SCALE_BLOCK and x.is_cuda:
        if x2.shape[0] > kernels.DECODE_ROWS:
            from hybridkv.ops.qgemm import scaled
            y = scaled.fp8_linear(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, scale, out_dtype)
            if y is not None:
                return y.view(*x.shape[:-1], weight.shape[0])
    return kernels.fp8_linear(x, weight, scale, out_dtype, block=block)


def widened_rows_ok(x2: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `float_rows.rows_linear` computes x2 · weightᵀ with a float32 result: the Triton path
    (`use_triton`), at most `float_rows.MAX_ROWS` rows, a weight of at most `MAX_WEIGHT_BYTES` with
    contiguous rows, half-precision or float32 operands, no gradient wanted, not deterministic mode
    (whose GEMMs are batch-invariant; this split depends on the rows)."""
    if x2.dim() != 2 or is_deterministic() or not use_triton(x2) or torch.is_grad_enabled() and (
            x2.requires_grad or weight.requires_grad):
        return False
    from hybridkv.ops.qgemm import float_rows
    floats = (torch.bfloat16, torch.float16, torch.float32)
    return (x2.shape[0] <= float_rows.MAX_ROWS and weight.nbytes <= float_rows.MAX_WEIGHT_BYTES
            and x2.dtype in floats and weight.dtype in floats and weight.stride(-1) == 1
            and x2.device == weight.device)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
               out_dtype: torch.dtype) -> torch.Tensor:
    """act_quant_sim(x) @ dequant(weight, scale)ᵀ -> [..., N] of out_dtype (see `reference`)."""
    if fp8_kernel_ok(x, weight, block):
        return packed_fp8_linear(x, weight, scale, out_dtype, block[1])
    return reference.fp8_linear(x, weight, scale, block, out_dtype)
