"""The device half of programmatic dependent launch for Triton kernels (`hybridkv.ops.pdl` says
why and what the contract is): a kernel with a `PDL` constexpr calls `wait_then_release(PDL)` before
its first global memory access."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    """With PDL: wait until the previous kernel has completed (its writes visible), then let the next
    kernel launch. Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
