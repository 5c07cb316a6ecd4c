"""Which implementation an op runs, and the deterministic (batch-invariant) mode.

The public function of every op calls `use_triton(tensor)`: Triton kernels run on CUDA tensors
when Triton imports, the plain-torch reference everywhere else. `HYBRIDKV_KERNELS` overrides that:
`reference` forces the reference on CUDA too (for A/B runs); `triton` forces the kernels on CPU
tensors as well, which only works under Triton's interpreter (`TRITON_INTERPRET=1`, set before
triton is imported): the tests run the engine's kernel path that way. Tests of single kernels call
the `triton` modules directly. `HYBRIDKV_DENSE_WEIGHTS=1` keeps dense copies of the quantised
weights instead of the packed-weight GEMMs (`dense_weights`).

Deterministic mode (`set_deterministic(True)` or `with deterministic():`) makes a token's result
independent of the batch it runs in: kernels use fixed split sizes and fixed reduction orders
that depend only on the token's own work, and on CUDA the torch matmuls and row reductions the
model uses are replaced by batch-invariant Triton kernels (`hybridkv.ops.batch_invariant`).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

_DETERMINISTIC = False


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_mode() -> str:
    mode = os.environ.get("HYBRIDKV_KERNELS", "auto")
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"HYBRIDKV_KERNELS={mode!r}: choose auto, reference or triton")
    return mode


def use_triton(x: torch.Tensor) -> bool:
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "triton" and not x.is_cuda:
        if not (interpreting() and triton_available()):
            raise RuntimeError("HYBRIDKV_KERNELS=triton on CPU tensors needs Triton with TRITON_INTERPRET=1 "
                               "(set before triton is imported)")
        return True
    return x.is_cuda and triton_available()


def dense_weights() -> bool:
    """`HYBRIDKV_DENSE_WEIGHTS=1`: quantised linears and experts dequantise their weights once and
    cache the dense copy, on CUDA too (the path before the packed-weight kernels; a benchmark
    baseline). Otherwise CUDA runs the kernels that read the packed weights."""
    return os.environ.get("HYBRIDKV_DENSE_WEIGHTS", "0") == "1"


def is_deterministic() -> bool:
    return _DETERMINISTIC


def set_deterministic(on: bool) -> None:
    """Switch batch-invariant execution on or off (process-wide)."""
    global _DETERMINISTIC
    _DETERMINISTIC = bool(on)
    if torch.cuda.is_available() and triton_available():
        from hybridkv.ops import batch_invariant
        batch_invariant.enable(on)


@contextlib.contextmanager
def deterministic(on: bool = True):
    prev = _DETERMINISTIC
    set_deterministic(on)
    try:
        yield
    finally:
        set_deterministic(prev)
