"""mHC mixing coefficients: split the 24 mixes into pre (σ), post (2σ) and a 4×4 combination made
doubly stochastic by Sinkhorn-Knopp (row softmax + eps, then alternate column/row normalisation;
`iters` normalisation rounds in total)."""

from __future__ import annotations

import torch


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [..., (2+hc)·hc] float32 -> pre [..., hc], post [..., hc], comb [..., hc, hc]."""
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]
    comb = comb.unflatten(-1, (hc, hc))
    comb = comb.softmax(-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb
