"""Walsh-Hadamard rotation (`reference`), and the indexer query's whole preparation (RoPE, Hadamard,
FP4 round trip) as one Triton launch on CUDA for forwards without autograd."""

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.hadamard.reference import hadamard_matrix, hadamard_transform  # noqa: F401


def rope_hadamard_fp4(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] -> fp4_round_trip(hadamard_transform(apply_rope(x, freqs)), 32), in x's dtype."""
    from hybridkv.ops.quant import fp4_round_trip
    from hybridkv.ops.rope import apply_rope
    d = x.shape[-1]
    if (use_triton(x) and not (torch.is_grad_enabled() and x.requires_grad) and x.dim() == 3 and d % 32 == 0
            and not d & (d - 1) and d >= 32 and freqs.dim() == 2 and freqs.shape[0] == x.shape[0]
            and x.dtype in (torch.float32, torch.bfloat16)):
        from hybridkv.ops.hadamard import triton as kernels
        return kernels.rope_hadamard_fp4(x, freqs)
    return fp4_round_trip(hadamard_transform(apply_rope(x, freqs)), 32)
