"""mHC mixing around each sub-block: `mhc_pre` (normalised mixes → σ gates and Sinkhorn → the
sub-block input) and `mhc_post` (write-back through post gates and the doubly stochastic
combination). One Triton kernel each on CUDA, the plain-torch reference elsewhere."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton
from hybridkv.ops.mhc import reference


def _ok(x: torch.Tensor) -> bool:
    hc = x.shape[1]
    return use_triton(x) and hc & (hc - 1) == 0


def mhc_pre(x: torch.Tensor, mixes_raw: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
            norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, dim], mixes_raw = flat(x) · fnᵀ [T, (2+hc)·hc] -> (y [T, dim], post [T, hc], comb [T, hc, hc])."""
    if _ok(x):
        from hybridkv.ops.mhc import triton as kernels
        return kernels.mhc_pre(x, mixes_raw, scale, base, iters, eps, norm_eps)
    return reference.mhc_pre(x, mixes_raw, scale, base, iters, eps, norm_eps)


def mhc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """x'_k = post_k · f + Σ_j comb[j, k] · x_j: f [T, dim], residual [T, hc, dim] -> [T, hc, dim]."""
    if _ok(residual):
        from hybridkv.ops.mhc import triton as kernels
        return kernels.mhc_post(f, residual, post, comb)
    return reference.mhc_post(f, residual, post, comb)
