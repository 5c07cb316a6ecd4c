"""Manifold-constrained hyper-connections: the residual stream is `hc` parallel copies; each
sub-block reads a σ-weighted mix of them and writes back through `post` weights and a doubly
stochastic (Sinkhorn) combination of the copies. Parameters are owned by the block (release names
`hc_{attn,ffn,head}_{fn,base,scale}`); these functions are the math.

V4 computes a sub-block's mixes from the stream it reads (`hc_pre`). V4.1's single-pass mHC
computes them from that stream too but collapses it with the `pre` mix the *previous* sub-block
computed (`hc_mixes` + `hc_collapse`), starting from a one-hot mix (`identity_pre`); the final
collapse before the LM head uses the last FFN's mix, and there is no hc head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.mhc import fn_in_kernels, mhc_head, mhc_mixes_collapse, mhc_post, mhc_pre, mhc_pre_fn, raw_mixes
from hybridkv.ops.sinkhorn import hc_split_sinkhorn


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """flat(x) · fnᵀ · rsqrt(mean(flat(x)²) + eps) in float32."""
    if fn_in_kernels(x, fn):      # one pass over x as stored, no float32 copy of it
        raw, ss = raw_mixes(x.flatten(1), fn)
        return raw * torch.rsqrt(ss / (x.shape[1] * x.shape[2]) + norm_eps).unsqueeze(-1)
    flat = x.flatten(1).float()
    return F.linear(flat, fn) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
             norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, dim] -> pre [T, hc], post [T, hc], comb [T, hc, hc]."""
    return hc_split_sinkhorn(_mixes(x, fn, norm_eps), scale, base, x.shape[1], iters, eps)


def hc_mixes_collapse(x: torch.Tensor, prev_pre: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                      base: torch.Tensor, iters: int, eps: float, norm_eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A V4.1 site: (hc_collapse(x, prev_pre), *hc_mixes(x, ...)); on the kernels' path two launches
    (the mixes, then the Sinkhorn and the collapse in one), elsewhere the two functions."""
    if fn_in_kernels(x, fn):
        return mhc_mixes_collapse(x, prev_pre, fn, scale, base, iters, eps, norm_eps)
    return (hc_collapse(x, prev_pre), *hc_mixes(x, fn, scale, base, iters, eps, norm_eps))


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_j pre_j · x_j: [T, hc, dim] x [T, hc] -> [T, dim]."""
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)


def identity_pre(x: torch.Tensor) -> torch.Tensor:
    """The one-hot mix V4.1's first sub-block collapses the stream with: [T, hc], copy 0 only."""
    pre = x.new_zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    pre[:, 0].fill_(1.0)           # (a fill, not a host scalar lifted to a tensor: capturable)
    return pre


def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, iters: int, eps: float,
           norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, hc, dim] -> (sub-block input [T, dim], post [T, hc], comb [T, hc, hc])."""
    if fn_in_kernels(x, fn):
        return mhc_pre_fn(x, fn, scale, base, iters, eps, norm_eps)
    return mhc_pre(x, F.linear(x.flatten(1).float(), fn), scale, base, iters, eps, norm_eps)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            over_residual: bool = False) -> torch.Tensor:
    """x'_k = post_k · f + Σ_j comb[j, k] · x_j (written over the residual where `over_residual`
    allows it: `ops.mhc.mhc_post`)."""
    return mhc_post(f, residual, post, comb, over_residual)


def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """Final collapse of the stream before the LM head: σ-weighted sum of the copies (no Sinkhorn)."""
    if fn_in_kernels(x, fn):      # two launches instead of a dozen torch operations
        return mhc_head(x, fn, scale, base, eps, norm_eps)
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale + base) + eps
    return (pre.unsqueeze(-1) * x.float()).sum(dim=1).to(x.dtype)
