"""Rotary position embedding (`reference`); on CUDA, forwards without autograd rotate in one Triton
launch (`triton.apply_rope`) instead of the reference's half-dozen torch operations."""

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.rope import reference
from hybridkv.ops.rope.reference import rope_freqs, yarn_inv_freq  # noqa: F401


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·freqs.shape[-1] dims of x [T, ..., D] by freqs [T, rd/2]; returns a new tensor."""
    if (use_triton(x) and not (torch.is_grad_enabled() and x.requires_grad)
            and freqs.shape[0] in (1, x.shape[0]) and freqs.dim() == 2):
        from hybridkv.ops.rope import triton as kernels
        return kernels.apply_rope(x, freqs, inverse)
    return reference.apply_rope(x, freqs, inverse)


def apply_rope_(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`apply_rope` in place where it can: x's last 2·freqs.shape[-1] dims rotated where they are,
    x returned (the kernel then reads and writes only those: an eighth of a V4 query's bytes). For a
    tensor the caller owns and no longer needs unrotated; under autograd a new tensor, as
    `apply_rope`."""
    if torch.is_grad_enabled() and x.requires_grad:
        return apply_rope(x, freqs, inverse)
    if (use_triton(x) and x.is_contiguous() and freqs.shape[0] in (1, x.shape[0]) and freqs.dim() == 2):
        from hybridkv.ops.rope import triton as kernels
        return kernels.apply_rope(x, freqs, inverse, in_place=True)
    rd = freqs.shape[-1] * 2
    x[..., x.shape[-1] - rd:] = reference.apply_rope(x[..., x.shape[-1] - rd:], freqs, inverse)
    return x
