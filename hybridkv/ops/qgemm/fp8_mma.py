"""FP8 linears at decode sizes (at most 8 rows) on the FP8 tensor cores, in CUDA C++ compiled at first
use (NVRTC, through torch): the release's e4m3 weight with e8m0 scales per 128×128 tile (V4) or
32×32 (V4.1, `SB` 32), the input quantised to e4m3 per 128 (or 32) values inside the kernel.

At decode a linear is a stream of its weight bytes: what costs is the latency of getting them in
flight, not the multiply. The Triton kernel (`triton.fp8_gemm_kernel`) reaches every SM with few
rows only by splitting K over programs, whose partial sums a last-arriving program adds (a store,
a fence, an atomic and a reload on the critical path), and pads the rows to a 16-row tile. Here
one block owns 16·MT output rows over all of K, its WK warps split K and add their partial tiles in
shared memory in a fixed order (deterministic, no second pass), and the rows are the MMA's B
operand (`mma.sync.m16n8k32`, e4m3 in, float32 accumulation):

- The weight is the A operand straight from memory: a thread loads 32 consecutive codes of rows g
  and g+8 (two 16-byte loads each) per 128-input chunk and feeds them to four MMAs; the MMA's k
  order only has to be permuted alike in both operands, so no byte is moved.
- The input row of token g is quantised by the quad that multiplies it (amax over the chunk's 128
  values by two shuffles, the power-of-two scale of `act_codes` bit for bit, round-to-nearest-even
  to e4m3 with saturation): no separate quantisation launch.
- Each chunk's four MMAs accumulate the 128-deep block; its float32 result is multiplied by the
  weight tile's and the token's scales (both powers of two, so exactly as `fp8_gemm_kernel`'s
  promotion) and added; the next chunk's weights and inputs are loaded before this one is used.
- With 32×32 tiles each MMA is one scale block: a thread loads 8 codes of each of the chunk's four
  32-input blocks (so MMA i's k runs over block i alone), the quad's amax is taken per block, and
  every MMA's result is scaled and added on its own.

Equal to the dequantise-then-GEMM reference within the FP8 tensor cores' accumulation (the GPU test
measures it); the CPU keeps the reference path, the interpreter the Triton kernel.
"""

from __future__ import annotations

import os

import torch

from hybridkv.ops import pdl
from hybridkv.ops.qgemm import nvrtc
from hybridkv.ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX

MAX_ROWS = 8               # rows per launch: the MMA's N
SCALE_BLOCK = 128          # V4's scale tiles
SCALE_BLOCKS = (128, 32)   # the scale tiles the kernel reads (V4.1's release: 32×32)

SOURCE = r"""
__device__ __forceinline__ void mma_e4m3(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// two floats -> two e4m3 bytes (lo in the low byte), round to nearest even, saturated to ±448
__device__ __forceinline__ u32 e4m3x2(float lo, float hi) {
    unsigned short d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

__device__ __forceinline__ float bf16_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(u32 v) { return __uint_as_float(v & 0xFFFF0000u); }

// this thread's 32 inputs of token row `row` (raw bits: 16 words of bf16 pairs, or 32 floats): SB 128,
// the 32 from input `off`; SB 32, the 8 from each of off, off + 32, off + 64 and off + 96 (in that order)
__device__ __forceinline__ void load_x(u32* xr, const void* X, long long row, int off, bool ok) {
#if XT == 0
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4* p = (const uint4*)((const unsigned short*)X + row + off) + (SB == 128 ? i : 4 * i);
        uint4 v = ok ? __ldg(p) : make_uint4(0u, 0u, 0u, 0u);
        xr[4 * i] = v.x; xr[4 * i + 1] = v.y; xr[4 * i + 2] = v.z; xr[4 * i + 3] = v.w;
    }
#else
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint4* p = (const uint4*)((const float*)X + row + off) + (SB == 128 ? i : 8 * (i >> 1) + (i & 1));
        uint4 v = ok ? __ldg(p) : make_uint4(0u, 0u, 0u, 0u);
        xr[4 * i] = v.x; xr[4 * i + 1] = v.y; xr[4 * i + 2] = v.z; xr[4 * i + 3] = v.w;
    }
#endif
}

__device__ __forceinline__ float x_at(const u32* xr, int i) {
#if XT == 0
    return (i & 1) ? bf16_hi(xr[i >> 1]) : bf16_lo(xr[i >> 1]);
#else
    return __uint_as_float(xr[i]);
#endif
}

#if XT == 0
#define XWORDS 16
#else
#define XWORDS 32
#endif

// NS scale blocks in a 128-input chunk
#define NS (128 / SB)

// the quad's 128 inputs -> this thread's 32 as e4m3 codes (8 words) and the scale of each of the
// chunk's NS blocks of SB inputs, as `act_codes`: s = 2^ceil(log2(max(amax, FLOOR) / 448)),
// codes = round(x / s). Each block's inputs are spread over the quad (SB 128: the thread's 32 of
// the 128; SB 32: its 8 of each block's 32), so its amax takes two shuffles.
__device__ __forceinline__ void quantise(const u32* xr, u32* xq, float* s) {
#pragma unroll
    for (int b = 0; b < NS; ++b) {
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 32 / NS; ++i) amax = fmaxf(amax, fabsf(x_at(xr, b * (32 / NS) + i)));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float t = fmaxf(amax, FLOOR) * (1.0f / QMAX);
        const u32 s_bits = (__float_as_uint(t) + 0x7FFFFFu) & 0x7F800000u;
        const float inv = __uint_as_float(0x7F000000u - s_bits);
#pragma unroll
        for (int w = b * (8 / NS); w < (b + 1) * (8 / NS); ++w) {
            const u32 lo = e4m3x2(x_at(xr, 4 * w) * inv, x_at(xr, 4 * w + 1) * inv);
            const u32 hi = e4m3x2(x_at(xr, 4 * w + 2) * inv, x_at(xr, 4 * w + 3) * inv);
            xq[w] = lo | (hi << 16);
        }
        s[b] = __uint_as_float(s_bits);
    }
}

extern "C" __global__ void __launch_bounds__(32 * WK)
fp8_linear_mma(const void* X, const u8* W, const u8* WS, void* Y, int M, int N, int K, int stride_x,
               int ws_stride, int stride_y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int n0 = blockIdx.x * (16 * MT);
    const int chunks = K / 128;
    const int mine = chunks > warp ? (chunks - warp + WK - 1) / WK : 0;     // chunks warp, warp + WK, ...
    const bool tok_ok = g < M;
    const long long xrow = tok_ok ? (long long)g * stride_x : 0;

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;

    // a chunk's weights: rows g and g+8 of each 16-row tile, this thread's 32 bytes of each (8 words)
    u32 w_cur[MT][2][8], w_next[MT][2][8], x_cur[XWORDS], x_next[XWORDS];
    auto offset = [&](int j) { return (warp + j * WK) * 128 + tq * (32 / NS); };    // this thread's inputs
    auto fetch = [&](int j, u32 (*w)[2][8], u32* xr, bool with_x) {
        if (j >= mine) return;
        const int off = offset(j);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const u8* row = W + (long long)(n0 + mt * 16 + g + 8 * h) * K + off;
#if SB == 128
                const uint4 a = __ldg((const uint4*)row), b = __ldg((const uint4*)row + 1);
                w[mt][h][0] = a.x; w[mt][h][1] = a.y; w[mt][h][2] = a.z; w[mt][h][3] = a.w;
                w[mt][h][4] = b.x; w[mt][h][5] = b.y; w[mt][h][6] = b.z; w[mt][h][7] = b.w;
#else
                // MMA i takes block i: this thread's 8 codes of each block, words 2i and 2i + 1
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const uint2 v = __ldg((const uint2*)(row + 32 * i));
                    w[mt][h][2 * i] = v.x; w[mt][h][2 * i + 1] = v.y;
                }
#endif
            }
        if (with_x) load_x(xr, X, xrow, off, tok_ok);
    };
    // the first chunk's weights (constant: read before the wait), then, once the kernel that wrote
    // the activations has completed, its activations
    fetch(0, w_cur, x_cur, false);
    pdl_wait_then_release();
    if (mine > 0) load_x(x_cur, X, xrow, offset(0), tok_ok);
    for (int j = 0; j < mine; ++j) {
        fetch(j + 1, w_next, x_next, true);
        u32 xq[8];
        float s[NS], s0[NS], s1[NS];
        quantise(x_cur, xq, s);
        // the scales of this thread's accumulator columns: tokens 2tq and 2tq + 1 (quads 2tq, 2tq + 1)
#pragma unroll
        for (int b = 0; b < NS; ++b) {
            s0[b] = __shfl_sync(0xffffffffu, s[b], 8 * tq);
            s1[b] = __shfl_sync(0xffffffffu, s[b], 8 * tq + 4);
        }
        const int chunk = warp + j * WK;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // the weight's scale tiles of this 16-row tile: one per chunk (SB 128), one per MMA (SB 32)
            const u8* ws = WS + (long long)((n0 + mt * 16) / SB) * ws_stride + chunk * NS;
            float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                mma_e4m3(c, w_cur[mt][0][2 * i], w_cur[mt][1][2 * i], w_cur[mt][0][2 * i + 1],
                         w_cur[mt][1][2 * i + 1], xq[2 * i], xq[2 * i + 1]);
                if (NS == 4 || i == 3) {     // a block's MMAs done: scale and add its sum
                    const int b = NS == 4 ? i : 0;
                    const float wsf = __uint_as_float(((u32)ws[b]) << 23);
                    const float f0 = wsf * s0[b], f1 = wsf * s1[b];
                    acc[mt][0] += c[0] * f0; acc[mt][1] += c[1] * f1;
                    acc[mt][2] += c[2] * f0; acc[mt][3] += c[3] * f1;
                    c[0] = c[1] = c[2] = c[3] = 0.f;
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
#pragma unroll
                for (int i = 0; i < 8; ++i) w_cur[mt][h][i] = w_next[mt][h][i];
#pragma unroll
        for (int i = 0; i < XWORDS; ++i) x_cur[i] = x_next[i];
    }

#if WK > 1
    // the warps' partial tiles added in warp order
    __shared__ float red[WK][32][4 * MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][lane][mt * 4 + i] = acc[mt][i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float a = red[0][lane][mt * 4 + i];
            for (int w = 1; w < WK; ++w) a += red[w][lane][mt * 4 + i];
            acc[mt][i] = a;
        }
#endif
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int token = 2 * tq + (i & 1);
            if (token < M) store_out(Y, (long long)token * stride_y + n0 + mt * 16 + g + 8 * (i >> 1), acc[mt][i]);
        }
}
"""

def enabled(block: int = SCALE_BLOCK) -> bool:
    """Whether decode-sized FP8 linears with `block`×`block` scale tiles (128: V4; 32: V4.1) take this
    kernel on CUDA: yes unless `HYBRIDKV_FP8_MMA=0` (then the Triton kernel, the A/B baseline)."""
    return os.environ.get("HYBRIDKV_FP8_MMA", "1") != "0" and block in SCALE_BLOCKS


def usable(x2: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, block: int = SCALE_BLOCK) -> bool:
    """Whether this kernel computes x2 [M, K] × weight [N, K]ᵀ with scale tiles of `block`: CUDA with
    FP8 MMA (sm_89 and newer) and torch's NVRTC loader, at most `MAX_ROWS` rows, bf16 or float32
    inputs, an e4m3 weight with contiguous rows, K a multiple of 128 and N of 16."""
    m, k = x2.shape
    n = weight.shape[0]
    return (block in SCALE_BLOCKS and enabled(block) and x2.is_cuda and 0 < m <= MAX_ROWS
            and x2.dtype in nvrtc.DTYPES_X and out_dtype in nvrtc.DTYPES_Y
            and weight.dtype == torch.float8_e4m3fn and weight.stride(-1) == 1 and weight.stride(0) == k
            and weight.data_ptr() % 16 == 0 and k % 128 == 0 and n % 16 == 0
            and nvrtc.available(x2.device.index, (8, 9), "FP8 linears at decode"))


def config(n: int, k: int, block: int = SCALE_BLOCK) -> dict:
    """MT (16-row tiles per block) and WK (warps splitting K) for an [n, k] weight with `block`×`block`
    scale tiles.

    128 (V4): more rows a block for wide weights; each warp two of the 128-input chunks, at most 16
    warps over a block's tiles (MT·WK ≤ 16), except where the weight is wide enough (MT 4) that its
    blocks alone fill the SMs: four chunks a warp. The fastest configuration at every V4-Flash FP8
    linear on an H100 with cold weights (`benchmarks/qgemm_kernels.py --sweep --cold --families
    fp8-mma`, 1 and 8 rows; one row: wkv 4.2 -> 3.5 µs, the shared expert's w1/w3 5.2 -> 4.8, its
    w2 and the indexer's wq_b from over 4.8 and 4.5 to 4.1 and 3.9, wq_a, wq_b and wo_b as the
    former fit); the engine's step did not move (docs/training-log.md).

    32 (V4.1, whose 8-byte weight loads per block keep fewer bytes in flight a warp): one 16-row tile
    a block (wq_b's 32768 rows: four, two warps), four warps over K, sixteen where that leaves fewer
    blocks than an H100 or H200 has SMs. Fitted on the H100 with cold weights (`--block 32 --cold
    --sweep`, one row): wo_b 0.0240 -> 0.0188 ms, the shared expert's w1/w3 0.0163 -> 0.0125, wq_a
    0.0064 -> 0.0052, wkv 0.0062 -> 0.0049 against the 128-tile fit."""
    chunks = k // 128
    if block == 32:
        mt = 4 if n >= 16384 and n % 64 == 0 else 1
        wk = 2 if mt == 4 else (16 if n // 16 < 128 else 4)
        return {"MT": mt, "WK": max(1, min(wk, chunks))}
    mt = 4 if n >= 16384 else (2 if n >= 4096 else 1)
    while n % (16 * mt):
        mt //= 2
    return {"MT": mt, "WK": max(1, min(16 // mt, chunks // (4 if mt == 4 else 2)))}


def source(x_dtype: torch.dtype, y_dtype: torch.dtype, mt: int, wk: int, block: int = SCALE_BLOCK,
           pdl: bool = False) -> str:
    """The CUDA C++ of one variant, as compiled at first use."""
    return nvrtc.source(SOURCE, x_dtype, y_dtype, MT=mt, WK=wk, SB=block, FLOOR=f"{FP8_AMAX_FLOOR!r}f",
                        QMAX=f"{FP8_MAX!r}f", PDL=int(pdl))


def fp8_linear(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               cfg: dict | None = None, block: int = SCALE_BLOCK) -> torch.Tensor:
    """x2 [M, K] (M ≤ 8, where `usable`) -> [M, N] of out_dtype: act_quant_sim(x2, block) ·
    dequant(weight)ᵀ with the weight's e8m0 scales [ceil(N/block), K/block]."""
    m, k = x2.shape
    n = weight.shape[0]
    cfg = dict(config(n, k, block), **(cfg or {}))
    mt, wk = int(cfg["MT"]), int(cfg["WK"])
    if mt not in (1, 2, 4) or not 1 <= wk <= 16 or n % (16 * mt):
        raise ValueError(f"FP8 MMA linear: MT {mt} (1, 2 or 4; N {n} a multiple of 16·MT), WK {wk} (1..16)")
    if block not in SCALE_BLOCKS:
        raise ValueError(f"FP8 MMA linear: scale tiles of {block} (one of {SCALE_BLOCKS})")
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or x2.stride(0) % 8:     # 16-byte loads of each row
        x2 = torch.empty(m, k, dtype=x2.dtype, device=x2.device).copy_(x2)
    sc = scale.view(torch.uint8)
    if sc.dim() != 2 or sc.shape[0] * block < n or sc.shape[1] * block != k or sc.stride(-1) != 1:
        raise ValueError(f"FP8 MMA linear: scales {tuple(sc.shape)} for a [{n}, {k}] weight ({block}×{block} tiles)")
    y = torch.empty(m, n, dtype=out_dtype, device=x2.device)
    variant = (x2.dtype, out_dtype, mt, wk, block, pdl.enabled(x2))
    kern = nvrtc.kernel(x2.device, "fp8_linear_mma", variant, lambda: source(*variant))
    nvrtc.launch(kern, x2.device, (n // (16 * mt), 1, 1), (32 * wk, 1, 1),
                 [x2, weight, sc, y, int(m), int(n), int(k), int(x2.stride(0)), int(sc.stride(0)), int(n)],
                 pdl=variant[-1])
    return y
