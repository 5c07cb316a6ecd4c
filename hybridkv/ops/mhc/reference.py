"""mHC sub-block input and output mixing (the math of SPEC §1.5), given the raw mixes
`flat(x) · fnᵀ` (a plain GEMM the caller runs):

    pre, post, comb = split_sinkhorn(mixes_raw · rsqrt(mean(flat(x)²) + eps))
    y   = Σ_j pre_j x_j                              (mhc_pre)
    x'_k = post_k · f + Σ_j comb[j, k] x_j           (mhc_post)
"""

from __future__ import annotations

import torch

from hybridkv.ops.sinkhorn import hc_split_sinkhorn


def mhc_pre(x: torch.Tensor, mixes_raw: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int,
            eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, dim], mixes_raw [T, (2+hc)·hc] -> (y [T, dim] x.dtype, post [T, hc], comb [T, hc, hc])."""
    flat = x.flatten(1).float()
    mixes = mixes_raw * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, x.shape[1], iters, eps)
    y = (pre.unsqueeze(-1) * x.float()).sum(dim=1)
    return y.to(x.dtype), post, comb


def mhc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """f [T, dim], residual [T, hc, dim] -> [T, hc, dim] of f.dtype."""
    y = post.unsqueeze(-1) * f.float().unsqueeze(1) + (comb.unsqueeze(-1) * residual.float().unsqueeze(2)).sum(1)
    return y.to(f.dtype)
