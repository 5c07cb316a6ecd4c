"""Rotary position embedding as in V4: interleaved (adjacent-pair) rotation of the last `rd` dims,
YaRN frequency interpolation without an attention-scale correction, and the inverse rotation used
on the attention output."""

from __future__ import annotations

import math

import torch


def yarn_inv_freq(dim: int, base: float, factor: float = 1.0, original_seq_len: int = 0,
                  beta_fast: float = 32, beta_slow: float = 1) -> torch.Tensor:
    """Inverse frequencies [dim/2]; YaRN-interpolated when original_seq_len > 0."""
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if original_seq_len > 0:
        def correction_dim(num_rotations: float) -> float:
            return dim * math.log(original_seq_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_freqs(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Complex rotations e^{i·pos·freq}: [len(positions), dim/2] complex64."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device).unsqueeze(0)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2·freqs.shape[-1] dims of x [T, ..., D] by freqs [T, rd/2]; returns a new tensor."""
    rd = freqs.shape[-1] * 2
    head = x[..., :-rd]
    tail = torch.view_as_complex(x[..., -rd:].float().reshape(*x.shape[:-1], rd // 2, 2).contiguous())
    f = freqs.conj() if inverse else freqs
    f = f.reshape(f.shape[0], *([1] * (x.dim() - 2)), f.shape[-1])
    rotated = torch.view_as_real(tail * f).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)
