"""mHC split + Sinkhorn. On the CPU the normalisation rounds run compiled (numba) when available;
the result is bit-identical to the reference."""

from __future__ import annotations

import torch

from hybridkv.ops.sinkhorn import cpu, reference


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if (cpu.AVAILABLE and mixes.device.type == "cpu" and mixes.dtype == torch.float32
            and not torch.is_grad_enabled()):
        return cpu.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
    return reference.hc_split_sinkhorn(mixes, scale, base, hc, iters, eps)
