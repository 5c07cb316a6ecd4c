"""Rotary position embedding (`reference`); on CUDA, forwards without autograd rotate in one Triton
launch (`triton.apply_rope`) instead of the reference's half-dozen torch operations, and the
rotations of a batch's positions are one launch too (`rope_freqs`)."""

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.rope import reference
from hybridkv.ops.rope.reference import yarn_inv_freq  # noqa: F401


def _rotations_in_kernel(positions: torch.Tensor) -> bool:
    """Integer positions on the Triton path: `triton.rope_freqs` computes their rotations."""
    return use_triton(positions) and not positions.dtype.is_floating_point


def rope_freqs(positions: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0,
               clamp_min: int | None = None) -> torch.Tensor:
    """Complex rotations e^{i·p·freq} [len(positions), dim/2] (complex64) at p = positions + offset,
    raised to clamp_min where given (integer arithmetic before the float32 conversion)."""
    if _rotations_in_kernel(positions):
        from hybridkv.ops.rope import triton as kernels
        return kernels.rope_freqs(positions, inv_freq, offset, clamp_min)
    p = positions + offset if offset else positions
    if clamp_min is not None:
        p = p.clamp(min=clamp_min)
    return reference.rope_freqs(p, inv_freq)


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


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, offset: int = 0,
                 clamp_min: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_freqs`'s real and imaginary parts (cos, sin), each contiguous float32."""
    if _rotations_in_kernel(positions):
        from hybridkv.ops.rope import triton as kernels
        return kernels.rope_freqs(positions, inv_freq, offset, clamp_min, split=True)
    f = rope_freqs(positions, inv_freq, offset, clamp_min)
    return f.real.contiguous(), f.imag.contiguous()
