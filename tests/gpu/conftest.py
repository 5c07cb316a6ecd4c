"""GPU tests: the kernels compiled for the device at V4-Flash shapes, and the deterministic mode.
Skipped without CUDA (and under the Triton interpreter)."""

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Tests that capture CUDA graphs run last: a capture that fails leaves the process's CUDA state
    unusable (every later CUDA call in it fails), which would bury the kernel tests' own results."""
    items.sort(key=lambda item: "graphs" in item.nodeid)
