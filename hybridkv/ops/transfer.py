"""Small host tables onto the device without draining its queue.

A copy from pageable host memory to a CUDA device waits for every kernel queued before it (the
driver stages it synchronously), so a prefill that builds index tables between launches (a batch's
token requests and positions, the indexer's tiles of consecutive tokens) would let the GPU run dry
at each and wait for the host to queue the next kernels. Staged in pinned memory, the copy is queued
like a kernel instead; torch's pinned-memory cache keeps the staging buffer until the copy is done.
"""

from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor | list, device: torch.device | str | None,
              dtype: torch.dtype | None = None) -> torch.Tensor:
    """`a` (an array, a host tensor or a list) as a tensor on `device` (of `dtype` if given), queued
    behind the device's work on CUDA rather than waiting for it."""
    if isinstance(a, torch.Tensor):
        t = a
    elif isinstance(a, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(a))
    else:
        t = torch.tensor(a, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    device = t.device if device is None else torch.device(device)
    if device.type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
