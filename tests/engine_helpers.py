"""Small helpers the engine, tier and training tests share."""

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of a against b."""
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt())


def prompts_of(lengths, seed=0, vocab=512) -> list[list[int]]:
    """Seeded random token prompts of the given lengths (ids 2..vocab-1: no BOS/EOS)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]
