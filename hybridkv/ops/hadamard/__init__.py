"""Walsh-Hadamard rotation (`reference`), and the FP4-stored heads' whole preparation as one Triton
launch on CUDA for forwards without autograd: V4's indexer queries (RoPE, Hadamard, FP4 round trip:
`rope_hadamard_fp4`), V4.1's indexer queries and keys and its global KV (RoPE, FP4 round trip:
`rope_fp4`)."""

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.hadamard.reference import hadamard_matrix, hadamard_transform  # noqa: F401


def _kernel_ok(x: torch.Tensor, freqs: torch.Tensor, block: int) -> bool:
    d = x.shape[-1]
    return (use_triton(x) and not (torch.is_grad_enabled() and x.requires_grad) and x.dim() == 3 and d % block == 0
            and not d & (d - 1) and d >= 32 and freqs.dim() == 2 and freqs.shape[0] == x.shape[0]
            and 2 * freqs.shape[-1] <= d and x.dtype in (torch.float32, torch.bfloat16))


def rope_hadamard_fp4(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] -> fp4_round_trip(hadamard_transform(apply_rope(x, freqs)), 32), in x's dtype."""
    from hybridkv.ops.quant import fp4_round_trip
    from hybridkv.ops.rope import apply_rope
    if _kernel_ok(x, freqs, 32):
        from hybridkv.ops.hadamard import triton as kernels
        return kernels.rope_hadamard_fp4(x, freqs)
    return fp4_round_trip(hadamard_transform(apply_rope(x, freqs)), 32)


def rope_fp4(x: torch.Tensor, freqs: torch.Tensor, block: int, scale_fmt: str = "ue8m0") -> torch.Tensor:
    """x [T, d] or [T, heads, d] -> fp4_round_trip(apply_rope(x, freqs), block, scale_fmt), in x's dtype."""
    from hybridkv.ops.quant import fp4_round_trip
    from hybridkv.ops.rope import apply_rope
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if scale_fmt in ("ue8m0", "e4m3") and block in (16, 32) and _kernel_ok(x3, freqs, block):
        from hybridkv.ops.hadamard import triton as kernels
        return kernels.rope_fp4(x3, freqs, hadamard=False, block=block, e4m3=scale_fmt == "e4m3").view(x.shape)
    return fp4_round_trip(apply_rope(x, freqs), block, scale_fmt)
