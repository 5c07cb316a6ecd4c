"""mHC mixing around each sub-block: `mhc_pre` (normalised mixes → σ gates and Sinkhorn → the
sub-block input) and `mhc_post` (write-back through post gates and the doubly stochastic
combination). One Triton kernel each on CUDA, the plain-torch reference elsewhere. The raw mixes
flat(x) · fnᵀ are computed by the kernels too (`fn_in_kernels`): `mhc_pre_fn` and `raw_mixes`."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import is_deterministic, use_triton
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


def mhc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
             over_residual: bool = False) -> torch.Tensor:
    """x'_k = post_k · f + Σ_j comb[j, k] · x_j: f [T, dim], residual [T, hc, dim] -> [T, hc, dim].
    `over_residual`: the caller reads the residual no more, so the kernel may write x' over it (the
    kernel reads each token's copies before it writes them); where it cannot (the reference path,
    a strided or differently typed residual, autograd), x' is a new tensor as without it."""
    if _ok(residual):
        from hybridkv.ops.mhc import triton as kernels
        over = (over_residual and residual.is_contiguous() and residual.dtype == f.dtype
                and not (torch.is_grad_enabled() and (residual.requires_grad or f.requires_grad)))
        return kernels.mhc_post(f, residual, post, comb, out=residual if over else None)
    return reference.mhc_post(f, residual, post, comb)


def fn_in_kernels(x: torch.Tensor, fn: torch.Tensor) -> bool:
    """Whether the mixes of x [T, hc, dim] with fn come from the kernels (`mhc_pre_fn`, `raw_mixes`;
    per-chunk partial sums, on the tensor cores beyond decode sizes): the Triton path, a float32 fn,
    no gradient wanted, not deterministic mode (whose GEMMs keep one path whatever the batch)."""
    return _ok(x) and not is_deterministic() and fn.dtype == torch.float32 and not (
        torch.is_grad_enabled() and (x.requires_grad or fn.requires_grad))


def mhc_pre_fn(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
               norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mhc_pre` with the raw mixes computed from fn [(2+hc)·hc, hc·dim] in the kernels (where
    `fn_in_kernels`): two launches that read the stream row twice."""
    from hybridkv.ops.mhc import triton as kernels
    return kernels.mhc_pre_fn(x, fn, scale, base, iters, eps, norm_eps)


def mhc_mixes_collapse(x: torch.Tensor, prev_pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                       base: torch.Tensor, iters: int, eps: float, norm_eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """V4.1's single-pass mHC site in the kernels (where `fn_in_kernels`): x [T, hc, dim] collapsed
    with the previous sub-block's pre mix [T, hc], and this site's pre, post and comb from x's own
    mixes: (y [T, dim], pre [T, hc], post [T, hc], comb [T, hc, hc]). Two launches."""
    from hybridkv.ops.mhc import triton as kernels
    return kernels.mhc_mixes_collapse(x, prev_pre, fn, scale, base, iters, eps, norm_eps)


def mhc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
             norm_eps: float) -> torch.Tensor:
    """The collapse before the LM head in the kernels (where `fn_in_kernels`): x [T, hc, dim] ->
    Σ_j (σ(mixes_j · scale + base_j) + eps) x_j [T, dim], mixes from fn [hc, hc·dim]. Two launches."""
    from hybridkv.ops.mhc import triton as kernels
    return kernels.mhc_head(x, fn, scale, base, eps, norm_eps)


def raw_mixes(x2: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x2 · fnᵀ, Σ x2² per row) in float32 for x2 [T, K] (where `fn_in_kernels`)."""
    from hybridkv.ops.mhc import triton as kernels
    return kernels.raw_mixes(x2, fn)
