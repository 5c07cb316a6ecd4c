"""The CUDA C++ kernels compiled at first use on the GPU (`qgemm.fp4_mma`, `qgemm.fp8_mma`) compile for sm_90 with
the CUDA toolkit's compiler, where one is installed: a source error shows here, not first on a GPU."""

import shutil
import subprocess

import pytest
import torch

from hybridkv.ops.qgemm import fp4_mma, fp8_mma

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("x_dtype,y_dtype,mt,wk,stages", [
    (torch.bfloat16, torch.bfloat16, 2, 2, 2), (torch.float32, torch.float32, 1, 8, 2),
    (torch.bfloat16, torch.float16, 1, 4, 4)])
def test_fp4_mma_kernels_compile_for_sm90(tmp_path, x_dtype, y_dtype, mt, wk, stages):
    stderr = _compile(tmp_path, fp4_mma.source(x_dtype, y_dtype, mt, wk, stages))
    assert "Compiling entry function 'grouped_fp4_mma'" in stderr


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("x_dtype,y_dtype,mt,wk", [
    (torch.bfloat16, torch.bfloat16, 1, 16), (torch.float32, torch.float32, 2, 4),
    (torch.bfloat16, torch.float16, 4, 1)])
def test_fp8_mma_kernel_compiles_for_sm90(tmp_path, x_dtype, y_dtype, mt, wk):
    stderr = _compile(tmp_path, fp8_mma.source(x_dtype, y_dtype, mt, wk))
    assert "Compiling entry function 'fp8_linear_mma'" in stderr


def _compile(tmp_path, source: str) -> str:
    """nvcc's ptxas report for the source compiled to an sm_90 cubin (no register spills allowed)."""
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    run = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "kernel.cubin"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "spill" not in run.stderr.replace("0 bytes spill", "")
    return run.stderr
