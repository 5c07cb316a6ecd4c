"""Kernel tests: on a machine without CUDA the Triton kernels run in the interpreter, which must be
switched on before any kernel is defined (Triton reads TRITON_INTERPRET at decoration time)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton  # noqa: F401
except ImportError:  # the kernels are optional on CPU; skip rather than fail without them
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"
