"""The CUDA C++ kernels compiled at first use on the GPU (`qgemm.fp4_mma`) compile for sm_90 with
the CUDA toolkit's compiler, where one is installed: a source error shows here, not first on a GPU."""

import shutil
import subprocess

import pytest
import torch

from hybridkv.ops.qgemm import fp4_mma

NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("x_dtype,y_dtype,mt,wk,stages", [
    (torch.bfloat16, torch.bfloat16, 2, 2, 2), (torch.float32, torch.float32, 1, 8, 2),
    (torch.bfloat16, torch.float16, 1, 4, 4)])
def test_fp4_mma_kernels_compile_for_sm90(tmp_path, x_dtype, y_dtype, mt, wk, stages):
    src = tmp_path / "fp4_mma.cu"
    src.write_text(fp4_mma.source(x_dtype, y_dtype, mt, wk, stages))
    run = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "fp4_mma.cubin"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in fp4_mma.KERNELS.values():
        assert f"Compiling entry function '{name}'" in run.stderr
    assert "spill" not in run.stderr.replace("0 bytes spill", "")
