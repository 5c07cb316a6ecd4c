"""What the packed GEMMs written in CUDA C++ (`fp4_mma`, `fp8_mma`) share: compiling a variant at
first use through torch's NVRTC loader (`torch.cuda._compile_kernel`) and caching it per device,
launching it on the current device's stream, and the source's common head (the variant's defines,
the integer types, and the output dtype's rounding and store, `YT`)."""

from __future__ import annotations

import functools
import warnings

import torch

DTYPES_X = {torch.bfloat16: 0, torch.float32: 1}                     # XT: the activations' dtype
DTYPES_Y = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}   # YT: the output's dtype

PRELUDE = r"""
typedef unsigned int u32;
typedef unsigned char u8;

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


def launch(kern, device: torch.device, grid: tuple[int, int, int], block: tuple[int, int, int], args: list) -> None:
    """Launch on `device`'s current stream (the loader launches on the current device's)."""
    with torch.cuda.device(device):
        kern(grid=grid, block=block, args=args)
