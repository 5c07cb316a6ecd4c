"""RMS normalisation by definition (the reference's arithmetic: float32, x · rsqrt(mean(x²) + eps),
then the weight)."""

from __future__ import annotations

import torch


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = rms_normalize(x, eps)
    return (y if weight is None else weight * y).to(x.dtype)
