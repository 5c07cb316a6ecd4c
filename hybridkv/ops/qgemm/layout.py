"""Triton helpers for reading the release's packed weights, shared by the GEMM kernels: e8m0
scale bytes as float32, and where one routed expert's bytes lie (stacked buffer or address table)."""

import triton
import triton.language as tl

from hybridkv.ops.qgemm.reference import FP4_WEIGHT_BLOCK as FP4_BLOCK  # noqa: F401 (inputs per e8m0 scale)


@triton.jit
def _e8m0(s):
    """e8m0 bytes (as uint8) -> 2^(s-127) in float32."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _expert_base(P, e, expert_stride, TABLE: tl.constexpr):
    """Expert e's packed weight (or scale) bytes: with TABLE, the 16-byte-aligned device address
    `P[e]` (separate tensors; the alignment lets the compiler use wide loads, `expert_tables` checks
    it); otherwise e · expert_stride bytes after P (the experts stacked in one buffer)."""
    # one return: a compiled kernel may not return two pointer types (int64 table, uint8 bytes)
    if TABLE:
        base = tl.multiple_of(tl.load(P + e), 16).to(tl.pointer_type(tl.uint8))
    else:
        base = P + e.to(tl.int64) * expert_stride
    return base
