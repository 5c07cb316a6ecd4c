"""Tests on several GPUs of one host: the sharded engine over NCCL. Skipped with fewer than two
GPUs (and under the Triton interpreter).

NCCL's NVLink multicast (NVLS) stays off: on hosts whose GPUs are shared through an NVSwitch
partition, a program that uses it can put the GPUs out of service. The workers inherit this
environment."""

import os

import pytest
import torch

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

if (not torch.cuda.is_available() or torch.cuda.device_count() < 2
        or os.environ.get("TRITON_INTERPRET") == "1"):
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
