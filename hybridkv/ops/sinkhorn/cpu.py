"""The Sinkhorn normalisation rounds of mHC compiled for the CPU with numba: the 4×4 matrices are
tiny, so the eager version's ~120 operator calls per site dominate a decode step; this runs them
as one loop. Sums are accumulated in the order torch's eager kernels use, so the result is
bit-identical to `reference.hc_split_sinkhorn`."""

from __future__ import annotations

import numpy as np
import torch

try:
    import numba
except ImportError:  # the package works without numba, only slower on the CPU
    numba = None


if numba is not None:
    @numba.njit(cache=True, nogil=True)
    def _normalize(c, iters, eps):  # pragma: no cover - compiled
        n = c.shape[1]
        for t in range(c.shape[0]):
            m = c[t]
            for r in range(iters * 2 - 1):
                if r % 2 == 0:  # columns first, then alternate
                    for k in range(n):
                        s = m[0, k]
                        for j in range(1, n):
                            s += m[j, k]
                        d = s + eps
                        for j in range(n):
                            m[j, k] = m[j, k] / d
                else:
                    for j in range(n):
                        s = m[j, 0]
                        for k in range(1, n):
                            s += m[j, k]
                        d = s + eps
                        for k in range(n):
                            m[j, k] = m[j, k] / d

AVAILABLE = numba is not None


def hc_split_sinkhorn(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre = torch.sigmoid(mixes[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[..., hc: 2 * hc] * scale[1] + base[hc: 2 * hc])
    comb = (mixes[..., 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = (comb.softmax(-1) + eps).contiguous()
    flat = comb.reshape(-1, hc, hc)
    _normalize(flat.numpy(), iters, np.float32(eps))
    return pre, post, comb
