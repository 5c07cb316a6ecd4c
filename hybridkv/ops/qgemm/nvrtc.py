"""What the kernels written in CUDA C++ (the packed GEMMs `fp4_mma` and `fp8_mma`, the indexer's
`indexer_topk.score_mma`) share: compiling a variant at first use through torch's NVRTC loader
(`torch.cuda._compile_kernel`) and caching it per device, launching it on the current device's stream
(with programmatic dependent launch where the variant was built for it: `hybridkv.ops.pdl`), and the
source's common head (the variant's defines, the integer types, the byte permute `prmt`, the output
dtype's rounding and store, `YT`, and `pdl_wait_then_release`)."""

from __future__ import annotations

import ctypes
import functools
import warnings

import torch

DTYPES_X = {torch.bfloat16: 0, torch.float32: 1}                     # XT: the activations' dtype
DTYPES_Y = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}   # YT: the output's dtype

PRELUDE = r"""
typedef unsigned int u32;
typedef unsigned char u8;

#ifndef PDL
#define PDL 0
#endif
// with PDL (the variant launched with programmatic stream serialization): wait until the previous
// kernel has completed and its writes are visible, then let the next kernel launch. Nothing that
// an earlier kernel writes may be read before this.
__device__ __forceinline__ void pdl_wait_then_release() {
#if PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// the byte permute: byte i of the result is byte (nibble i of sel) of {b, a} (a holds bytes 0-3); a
// nibble with bit 3 set gives that byte's sign bit repeated
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

#if YT < 2
// v rounded to the 16-bit output dtype, as stored
__device__ __forceinline__ unsigned short out_bits(float v) {
    unsigned short h;
#if YT == 0
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
    return h;
}
#endif

// v rounded to the output dtype, back in float32
__device__ __forceinline__ float round_out(float v) {
#if YT == 0
    return __uint_as_float(((u32)out_bits(v)) << 16);
#elif YT == 1
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(out_bits(v)));
    return f;
#else
    return v;
#endif
}

__device__ __forceinline__ void store_out(void* Y, long long i, float v) {
#if YT < 2
    ((unsigned short*)Y)[i] = out_bits(v);
#else
    ((float*)Y)[i] = v;
#endif
}
"""

_COMPILED: dict = {}


def source(body: str, x_dtype: torch.dtype, y_dtype: torch.dtype, **defines) -> str:
    """A variant's CUDA C++: its defines (XT, YT and `defines`), the shared prelude, then `body`."""
    head = {"XT": DTYPES_X[x_dtype], "YT": DTYPES_Y[y_dtype], **defines}
    return "".join(f"#define {k} {v}\n" for k, v in head.items()) + PRELUDE + body


@functools.lru_cache(maxsize=None)
def available(index: int | None, capability: tuple[int, int], what: str) -> bool:
    """Whether device `index` reaches `capability` and this torch has the NVRTC loader (warned once,
    naming `what` runs slower without it)."""
    if torch.cuda.get_device_capability(index) < capability:
        return False
    if not hasattr(torch.cuda, "_compile_kernel"):
        warnings.warn(f"torch {torch.__version__} has no NVRTC loader (torch.cuda._compile_kernel): {what} run "
                      "the slower Triton kernels", stacklevel=3)
        return False
    return True


def kernel(device: torch.device, name: str, variant: tuple, make_source):
    """The compiled kernel `name` of this variant on `device` (`make_source()` compiled on first use,
    which must happen outside CUDA-graph capture)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, name, variant)
    if key not in _COMPILED:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"CUDA kernel {name}: the first launch of variant {variant} must run outside "
                               "CUDA-graph capture (it compiles it)")
        with torch.cuda.device(index):
            major, minor = torch.cuda.get_device_capability(index)
            _COMPILED[key] = torch.cuda._compile_kernel(make_source(), name, compute_capability=f"{major}{minor}")
    return _COMPILED[key]


def launch(kern, device: torch.device, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
           pdl: bool = False) -> None:
    """Launch on `device`'s current stream (the loader launches on the current device's). `pdl`: with
    programmatic stream serialization (the variant must have been compiled with PDL 1, so that it
    waits before reading what earlier kernels write)."""
    with torch.cuda.device(device):
        if pdl:
            _launch_pdl(kern, grid, block, args)
        else:
            kern(grid=grid, block=block, args=args)


# CUDA driver structures of cuLaunchKernelEx (cuda.h, CUDA 12): one attribute, programmatic stream
# serialization (id 6), whose value union (64 bytes) starts with the int that allows it
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("value_pad", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def kernel_args(args: list) -> tuple[ctypes.Array, list]:
    """The kernel-parameter array of `args` as torch's loader builds it (a tensor: its data pointer;
    an int: a 32-bit int; a float: a double), and the values it points at (to keep alive)."""
    values = []
    for a in args:
        if isinstance(a, torch.Tensor):
            values.append(ctypes.c_void_p(a.data_ptr()))
        elif isinstance(a, bool) or not isinstance(a, (int, float)):
            raise TypeError(f"kernel argument of type {type(a).__name__}: tensors, ints and floats only")
        elif isinstance(a, int):
            values.append(ctypes.c_int(a))
        else:
            values.append(ctypes.c_double(a))
    array = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
    return array, values


def _launch_pdl(kern, grid, block, args: list) -> None:
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
    config = _LaunchConfig(*grid, *block, 0, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                           ctypes.pointer(attr), 1)
    params, keep = kernel_args(args)
    lib = torch.cuda._utils._get_gpu_runtime_library()
    err = lib.cuLaunchKernelEx(ctypes.byref(config), kern.func, params, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")
    del keep
