"""Index ranges made once per device and dtype, then handed out as views: on the GPU each
`torch.arange` is a kernel launch (a node of a captured step's graph), where a decode step asks
for the same rows every time. What `arange` returns is shared: callers only read it.

Inside a CUDA graph capture nothing new is cached (a tensor made there holds its values only
once the graph replays); the warm-up that runs the step before its capture fills the cache. A
range the cache outgrows is kept alive: a graph captured with a view of it reads it at every replay
by address, whatever Python holds."""

from __future__ import annotations

import torch

_RANGES: dict[tuple[str, torch.dtype], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []


def arange(start: int, end: int | None = None, *, device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """torch.arange(start, end) (or arange(start) with one bound) as a view of a cached range."""
    if end is None:
        start, end = 0, start
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (str(device), dtype)
    have = _RANGES.get(key)
    if have is None or have.numel() < end:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.arange(start, end, device=device, dtype=dtype)
        if have is not None:
            _OUTGROWN.append(have)
        have = torch.arange(max(end, 2 * (0 if have is None else have.numel()), 4096), device=device, dtype=dtype)
        _RANGES[key] = have
    return have[start:end]
