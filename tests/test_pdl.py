"""Programmatic dependent launch (hybridkv.ops.pdl): the switch, the launch arguments, and the driver
structures of the CUDA C++ kernels' launch. On the GPU, tests/gpu runs the decode step with it on
against the same step without it."""

import ast
import ctypes
import importlib
import inspect
import textwrap

import pytest
import torch

from hybridkv.ops import pdl
from hybridkv.ops.qgemm import nvrtc


def test_on_by_default_for_hopper_never_on_the_cpu(monkeypatch):
    x = torch.zeros(2)
    for flag in (None, "1", "0"):
        if flag is None:
            monkeypatch.delenv("HYBRIDKV_PDL", raising=False)
        else:
            monkeypatch.setenv("HYBRIDKV_PDL", flag)
        assert not pdl.enabled(x) and pdl.triton_args(x) == {"PDL": False}     # CPU tensors: never
    # a CUDA tensor's device decides where the switch allows it (the capability check stubbed:
    # this machine may have no GPU)
    cuda_x = torch.empty(2, device="meta")
    monkeypatch.setattr(type(cuda_x), "is_cuda", property(lambda self: True))
    monkeypatch.setattr(pdl, "_device_supports", lambda index: index == 0)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.delenv("HYBRIDKV_PDL", raising=False)
    assert pdl.enabled(cuda_x) and pdl.triton_args(cuda_x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("HYBRIDKV_PDL", "0")
    assert not pdl.enabled(cuda_x)
    monkeypatch.setattr(pdl, "_device_supports", lambda index: False)      # before Hopper
    monkeypatch.setenv("HYBRIDKV_PDL", "1")
    assert not pdl.enabled(cuda_x)
    monkeypatch.setenv("HYBRIDKV_PDL", "yes")
    with pytest.raises(ValueError, match="HYBRIDKV_PDL"):
        pdl.enabled(x)


# kernels that load weights before their wait, and the upper-case parameters (pointers and sizes) they
# may name there: no earlier kernel writes a weight
LOAD_BEFORE_WAIT = {"gemv_kernel": {"W", "N", "K"}}


def test_every_pdl_kernel_waits_before_anything_else():
    """The contract: a kernel launched with PDL waits first. Every Triton kernel with a PDL
    constexpr calls `wait_then_release(PDL)` as its first statement (after its docstring), or, for
    the kernels of LOAD_BEFORE_WAIT, as a later top-level statement with no pointer but its weights
    (and their sizes) named before it."""
    modules = ["rmsnorm.triton", "rope.triton", "mhc.triton", "quant.triton", "qgemm.float_rows", "compress.triton",
               "window.triton", "sparse_attn.triton", "grouped_moe.triton", "hadamard.triton", "indexer_topk.triton",
               "indexer_topk.select", "speculative.triton"]
    seen = 0
    for name in modules:
        mod = importlib.import_module(f"hybridkv.ops.{name}")
        for attr in vars(mod).values():
            fn = getattr(attr, "fn", None)
            if fn is None or fn.__name__ == "wait_then_release" or "PDL" not in inspect.signature(fn).parameters:
                continue
            body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
            if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]                                      # the docstring
            waits = [i for i, st in enumerate(body) if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call)
                     and ast.unparse(st.value) == "wait_then_release(PDL)"]
            assert waits, (name, fn.__name__, "no wait_then_release(PDL) at the top level")
            if fn.__name__ not in LOAD_BEFORE_WAIT:
                assert waits[0] == 0, (name, fn.__name__, ast.unparse(body[0]))
            else:
                params = inspect.signature(fn).parameters
                pointers = {p for p, v in params.items() if p.isupper() and v.annotation is inspect.Parameter.empty}
                before = {n.id for st in body[:waits[0]] for n in ast.walk(st) if isinstance(n, ast.Name)}
                assert not (before & pointers) - LOAD_BEFORE_WAIT[fn.__name__], (fn.__name__, before & pointers)
            seen += 1
    assert seen >= 20


def test_launch_structures_match_the_driver_abi():
    """cuLaunchKernelEx's CUlaunchConfig and CUlaunchAttribute (cuda.h, 64-bit): sizes and offsets."""
    assert ctypes.sizeof(nvrtc._LaunchAttribute) == 72
    assert nvrtc._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(nvrtc._LaunchConfig) == 56
    assert (nvrtc._LaunchConfig.stream.offset, nvrtc._LaunchConfig.attrs.offset,
            nvrtc._LaunchConfig.num_attrs.offset) == (32, 40, 48)


def test_kernel_arguments_as_the_loader_passes_them():
    """Tensors as their data pointers, ints as 32-bit ints, floats as doubles (what the kernels'
    signatures take), anything else refused."""
    t = torch.zeros(4)
    params, keep = nvrtc.kernel_args([t, 7, 0.25])
    assert len(params) == 3
    assert ctypes.cast(params[0], ctypes.POINTER(ctypes.c_void_p))[0] == t.data_ptr()
    assert ctypes.cast(params[1], ctypes.POINTER(ctypes.c_int))[0] == 7
    assert ctypes.cast(params[2], ctypes.POINTER(ctypes.c_double))[0] == 0.25
    for bad in (True, "x", None):
        with pytest.raises(TypeError):
            nvrtc.kernel_args([bad])
