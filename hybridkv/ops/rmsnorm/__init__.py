"""RMS normalisation of the last dimension, with an optional float32 weight: computed in float32,
returned in the input's dtype. One Triton program per row on CUDA (forwards without autograd: the
norms of a decode step are eight small launches each in torch); the plain-torch reference
elsewhere, which training and the CPU parity tests run."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.rmsnorm import reference


def _kernel_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    needs_grad = x.requires_grad or (weight is not None and weight.requires_grad)
    return use_triton(x) and not (torch.is_grad_enabled() and needs_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dimension (weight None: no weight)."""
    if _kernel_ok(x, weight):
        from hybridkv.ops.rmsnorm import triton as kernels
        return kernels.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def rms_norm_(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`rms_norm` written over x where it can (the Triton path, contiguous rows: each program reads
    its whole row before it writes it), x returned: for a tensor the caller owns and no longer needs
    unnormalised (a V4 prefill chunk's query heads: one [T, H, D] tensor instead of two). Elsewhere
    (the reference path, autograd, strided rows) a new tensor, as `rms_norm`."""
    if _kernel_ok(x, weight) and x.is_contiguous():
        from hybridkv.ops.rmsnorm import triton as kernels
        kernels.rms_norm(x, weight, eps, in_place=True)
        return x
    return rms_norm(x, weight, eps)
