"""RMSNorm with a float32 weight; computes in float32 and returns the input dtype."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_normalize(x, self.eps)).to(x.dtype)
