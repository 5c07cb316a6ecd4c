"""The CUDA C++ kernels compiled at first use on the GPU (`qgemm.fp4_mma`, `qgemm.fp8_mma`, `indexer_topk.score_mma`)
compile for sm_90 with the CUDA toolkit's compiler, where one is installed, and with NVRTC (what the GPU path runs),
where its library is found: a source error shows here, not first on a GPU. NVRTC is stricter than nvcc: it compiles
an unannotated function (a generic lambda's call operator, for one) as a host function and refuses it."""

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv.ops.indexer_topk import score_mma
from hybridkv.ops.qgemm import fp4_mma, fp8_mma

NVCC = shutil.which("nvcc")


def _find_nvrtc() -> ctypes.CDLL | None:
    """libnvrtc from $HYBRIDKV_NVRTC, the system's library path, or an nvidia-cuda-nvrtc wheel on sys.path."""
    candidates = [os.environ.get("HYBRIDKV_NVRTC"), ctypes.util.find_library("nvrtc")]
    for root in sys.path:
        candidates += sorted(str(p) for p in Path(root or ".").glob("nvidia/*/lib/libnvrtc.so*")
                             if "builtins" not in p.name and ".alt." not in p.name)
    for name in filter(None, candidates):
        try:
            for builtins in Path(name).parent.glob("libnvrtc-builtins.so*"):   # NVRTC opens it by name
                if ".alt." not in builtins.name:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


NVRTC = _find_nvrtc()


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("x_dtype,y_dtype,mt,wk,stages,pdl,ck", [
    (torch.bfloat16, torch.bfloat16, 2, 2, 2, False, 1), (torch.float32, torch.float32, 1, 8, 2, False, 1),
    (torch.bfloat16, torch.float16, 1, 4, 4, False, 1), (torch.bfloat16, torch.bfloat16, 1, 4, 2, True, 2),
    (torch.bfloat16, torch.bfloat16, 2, 1, 2, False, 4), (torch.bfloat16, torch.bfloat16, 2, 4, 3, True, 1)])
def test_fp4_mma_kernels_compile_for_sm90(tmp_path, x_dtype, y_dtype, mt, wk, stages, pdl, ck):
    source = fp4_mma.source(x_dtype, y_dtype, mt, wk, stages, pdl, ck)
    stderr = _compile(tmp_path, source)
    assert "Compiling entry function 'grouped_fp4_mma'" in stderr
    assert _waits(tmp_path, source) == pdl


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("x_dtype,y_dtype,mt,wk,pdl", [
    (torch.bfloat16, torch.bfloat16, 1, 16, False), (torch.float32, torch.float32, 2, 4, False),
    (torch.bfloat16, torch.float16, 4, 1, False), (torch.bfloat16, torch.bfloat16, 4, 8, True)])
def test_fp8_mma_kernel_compiles_for_sm90(tmp_path, x_dtype, y_dtype, mt, wk, pdl):
    source = fp8_mma.source(x_dtype, y_dtype, mt, wk, pdl=pdl)
    stderr = _compile(tmp_path, source)
    assert "Compiling entry function 'fp8_linear_mma'" in stderr
    assert _waits(tmp_path, source) == pdl


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler (nvcc) on this machine")
@pytest.mark.parametrize("q_dtype,w_dtype,heads,ratio,tile_n,pdl", [
    (torch.bfloat16, torch.float32, 64, 4, 64, True), (torch.float32, torch.bfloat16, 12, 0, 16, False),
    (torch.bfloat16, torch.bfloat16, 32, 4, 32, False)])
def test_indexer_score_kernel_compiles_for_sm90(tmp_path, q_dtype, w_dtype, heads, ratio, tile_n, pdl):
    source = score_mma.source(q_dtype, w_dtype, heads, 32, ratio, tile_n, pdl)
    stderr = _compile(tmp_path, source)
    assert "Compiling entry function 'indexer_score_fp4'" in stderr
    assert _waits(tmp_path, source) == pdl


@pytest.mark.skipif(NVRTC is None, reason="no NVRTC library on this machine (HYBRIDKV_NVRTC names one)")
@pytest.mark.parametrize("name,source", [
    ("grouped_fp4_mma", lambda: fp4_mma.source(torch.bfloat16, torch.bfloat16, 2, 4, 3, True, 1)),
    ("fp8_linear_mma", lambda: fp8_mma.source(torch.bfloat16, torch.bfloat16, 4, 8, pdl=True)),
    ("indexer_score_fp4", lambda: score_mma.source(torch.bfloat16, torch.float32, 64, 32, 4, 64, True)),
    ("indexer_score_fp4", lambda: score_mma.source(torch.float32, torch.bfloat16, 12, 32, 0, 16, False))])
def test_kernels_compile_with_nvrtc(name, source):
    prog = ctypes.c_void_p()
    assert NVRTC.nvrtcCreateProgram(ctypes.byref(prog), source().encode(), f"{name}.cu".encode(), 0, None, None) == 0
    options = [b"--gpu-architecture=sm_90"]
    try:
        code = NVRTC.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        NVRTC.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        NVRTC.nvrtcGetProgramLog(prog, log)
    finally:
        NVRTC.nvrtcDestroyProgram(ctypes.byref(prog))
    assert code == 0, log.value.decode()[-3000:]


def _compile(tmp_path, source: str) -> str:
    """nvcc's ptxas report for the source compiled to an sm_90 cubin (no register spills allowed)."""
    src = tmp_path / "kernel.cu"
    src.write_text(source)
    run = subprocess.run([NVCC, "-arch=sm_90", "-cubin", "-Xptxas", "-v", "-o", str(tmp_path / "kernel.cubin"),
                          str(src)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "spill" not in run.stderr.replace("0 bytes spill", "")
    return run.stderr


def _waits(tmp_path, source: str) -> bool:
    """Whether the source's PTX waits for the previous grid (programmatic dependent launch), and
    then releases the next one."""
    src = tmp_path / "kernel_ptx.cu"
    src.write_text(source)
    run = subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-o", str(tmp_path / "kernel.ptx"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = (tmp_path / "kernel.ptx").read_text()
    return "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
