"""RMSNorm with a float32 weight; computes in float32 and returns the input dtype
(`hybridkv.ops.rmsnorm`: a Triton kernel on CUDA, the reference elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.ops.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
