"""Walsh-Hadamard rotation of the last dim (Sylvester order), scaled by d^-1/2: the rotation V4
applies to indexer queries and keys before their FP4 round trip."""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
@torch.inference_mode(False)   # cached across calls: never an inference tensor, or training could not use it
def _hadamard_matrix(n: int) -> torch.Tensor:
    if n & (n - 1):
        raise ValueError(f"Hadamard size {n} is not a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


_ON_DEVICE: dict[tuple[int, torch.device], torch.Tensor] = {}


@torch.inference_mode(False)
def hadamard_matrix(n: int, device: torch.device | str) -> torch.Tensor:
    """The ±1 matrix [n, n] (float32, unscaled) on `device`, kept there: a copy from the host every
    call would be a transfer per step (and is not allowed while a CUDA graph is being captured)."""
    key = (n, torch.device(device))
    if key not in _ON_DEVICE:
        _ON_DEVICE[key] = _hadamard_matrix(n).to(device=device, dtype=torch.float32).contiguous()
    return _ON_DEVICE[key]


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1]
    return (x.float() @ hadamard_matrix(d, x.device) * d**-0.5).to(x.dtype)
