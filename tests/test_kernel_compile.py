"""The decode step's Triton kernels compile for sm_90 in every variant the engine can launch (a
kernel the interpreter runs can still be refused by the GPU's compiler: a grouped FP4 variant
once was, and the engine fell back to its slower multiply)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).with_name("sm90_compile.py")


def test_decode_kernels_compile_for_sm90():
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=900)
    lines = [line for line in run.stdout.splitlines() if ": " in line]
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(lines) == 2 * 3 * 2 * 2 + 2 * 2 + 3 * 2 + 1 + 4 + 6 + 3 * 3 + 1 + 2 + 2 + 2 + 3 + 2 + 2 + 1 + 2 + 1 + 1 + 1 + 1 + 2 + 2 + 5 + 1 + 2 + 3 + 2 + 1 + 2 + 3
    failed = [line for line in lines if not line.endswith(": ok")]
    assert not failed, "\n".join(failed)
