"""RMS normalisation of the last dimension, with an optional float32 weight: computed in float32,
returned in the input's dtype. One Triton program per row on CUDA (forwards without autograd: the
norms of a decode step are eight small launches each in torch); the plain-torch reference
elsewhere, which training and the CPU parity tests run. `rms_norm_rope`: the norm followed by the
rotary embedding, one launch on the Triton path."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.rmsnorm import reference
from hybridkv.ops.rope import apply_rope


def _kernel_ok(x: torch.Tensor, weight: torch.Tensor | None) -> bool:
    needs_grad = x.requires_grad or (weight is not None and weight.requires_grad)
    return use_triton(x) and not (torch.is_grad_enabled() and needs_grad)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """weight · x / sqrt(mean(x²) + eps) over the last dimension (weight None: no weight)."""
    if _kernel_ok(x, weight):
        from hybridkv.ops.rmsnorm import triton as kernels
        return kernels.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, freqs: torch.Tensor,
                  in_place: bool = False) -> torch.Tensor:
    """`apply_rope(rms_norm(x, weight, eps), freqs)` (freqs complex [T or 1, rd/2]), bit for bit, in
    one launch on the Triton path (strided rows too). `in_place`: written over x where it can (the
    Triton path, x contiguous), for a tensor the caller no longer needs unnormalised (a V4 prefill
    chunk's query heads: one [T, H, D] tensor instead of two); elsewhere a new tensor."""
    if _kernel_ok(x, weight) and freqs.dim() == 2 and freqs.shape[0] in (1, x.shape[0]):
        from hybridkv.ops.rmsnorm import triton as kernels
        return kernels.rms_norm_rope(x, weight, eps, freqs, in_place=in_place and x.is_contiguous())
    return apply_rope(rms_norm(x, weight, eps), freqs)
