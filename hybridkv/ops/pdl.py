"""Programmatic dependent launch (PDL, Hopper and newer) for the decode step's kernels.

A decode step at small batch is hundreds of kernels that each move few bytes; each pays its launch
and ramp-up (the grid's blocks placed on the SMs, the first loads' latency) after the previous
kernel has drained. With PDL a kernel is launched with CUDA's programmatic stream serialization:
it may start while its predecessor is still running, does what does not depend on it (a GEMM's
first weight loads), and waits at `griddepcontrol.wait` until the predecessor has completed and
its writes are visible. Right after that wait it signals `griddepcontrol.launch_dependents`, so
that the next kernel may be launched as early in turn.

The contract every PDL kernel keeps: no global memory that an earlier kernel writes is read, and
none is written, before its wait (it blocks until every prerequisite grid has completed, so the
chain is safe transitively and whatever the predecessor was). A kernel launched without the
attribute (torch's own) runs after its predecessor as always. The kernels take a `PDL` constexpr
(Triton) or define (CUDA C++) and run exactly as before without it.

It is on for CUDA devices of compute capability 9.0 and newer (the decode step's graph replays in
the same time or less with it, to the same bits: BENCHMARKS.md); `HYBRIDKV_PDL=0` turns it off.
The CPU, Triton's interpreter and older GPUs never use it. Under PDL a kernel's profiled time
includes its wait for its predecessor, so kernel times summed overlap: a step's device time is its
graph's replay time."""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels launched on x's device use PDL: a CUDA tensor on sm_90+, unless `HYBRIDKV_PDL=0`."""
    flag = os.environ.get("HYBRIDKV_PDL", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"HYBRIDKV_PDL={flag!r}: 0 or 1")
    if flag == "0" or not x.is_cuda:
        return False
    return _device_supports(x.device.index if x.device.index is not None else torch.cuda.current_device())


def triton_args(x: torch.Tensor) -> dict:
    """The launch arguments of a Triton kernel with a `PDL: tl.constexpr` parameter: its constexpr,
    and Triton's `launch_pdl` option where PDL is on."""
    return {"PDL": True, "launch_pdl": True} if enabled(x) else {"PDL": False}
