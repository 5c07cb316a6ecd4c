"""The routed experts' packed FP4 GEMM at decode sizes on the tensor cores, in CUDA C++ compiled at
first use (NVRTC, through torch): up to 8 sorted rows of one expert per tile.

At decode an expert sees one to a few rows, so what bounds the GEMM is not the multiply but the
work of turning each packed code into an operand. Triton's scaled dot widens the codes and stages
them through shared memory into the MMA layout; the CUDA-core kernel (`fp4_rows`) spends about six
instructions on each code. Here the weight is the MMA's A operand (16 weight rows × 16 inputs) and
up to 8 rows of activations its B operand (`mma.sync.m16n8k16`, bf16 in, float32 accumulation), and
each thread builds its A fragments in registers straight from the 16 bytes it loaded:

- The MMA only needs the same permutation of the K index in A and B, so each thread takes 32
  consecutive codes of a weight row (one 16-byte load, one e8m0 scale) and the activations at the
  same positions. Codes j and j+4 of a 32-bit word lie 16 bits apart, as the two halves of a
  bf16x2 register do, so one shift and mask per half-word pair move both codes' magnitude bits onto
  a bf16 exponent's two low bits and its mantissa's top bit (the E2M1 value times 2^-126, exact;
  0.5 is a bf16 subnormal, which bf16 arithmetic keeps), and one more shift and mask its sign bits.
- One bf16x2 multiply by 2^(s-1-S) (s the row's e8m0 scale byte, S the launch's `shift`, 0 unless a
  scale exceeds 2) turns a pair into the dequantised weights, exactly (a power of two); the float32
  result is multiplied by 2^S.
- Each warp streams its share of K through `STAGES` shared-memory buffers (cp.async, `CK` chunks
  of 128 inputs a buffer), the activations and scale bytes one chunk ahead in registers. `WK` warps
  split K and add their partial tiles in a fixed order (deterministic), then write the tile's
  outputs: with w3, each projection rounded to the output dtype, clamped, SwiGLU'd and multiplied
  by the routing weight, as `triton.grouped_fp4` does.
- About 3.6 SASS instructions a code in the loop (five a pair of codes to build the operand), where
  the CUDA-core kernel issues 6.4; the tensor cores do the multiplies.

Same contract as `triton.grouped_fp4` (its tile table built with BM 8): activations already through
their FP8 round trip (exact in bf16, so float32 activations are read as bf16 without loss); the
products are the dequantise-then-multiply products; only the tensor cores' float32 accumulation
order differs.
"""

from __future__ import annotations

import os

import torch

from hybridkv.ops import pdl
from hybridkv.ops.qgemm import nvrtc

TILE_ROWS = 8              # activation rows per tile: the MMA's N
SOURCE = r"""
// codes J and J+4 of w (bits 4J.. and 4J+16..) -> bf16x2 (low half: code J), each the E2M1 value
// times 2^-126: magnitude bits to bf16 bits 6..8, sign to bit 15
template <int J> __device__ __forceinline__ u32 e2m1_pair(u32 w) {
    u32 mag = (J == 0 ? w << 6 : J == 1 ? w << 2 : J == 2 ? w >> 2 : w >> 6) & 0x01C001C0u;
    u32 sgn = (J == 0 ? w << 12 : J == 1 ? w << 8 : J == 2 ? w << 4 : w) & 0x80008000u;
    return mag | sgn;
}

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
}

__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// the scale multiplier 2^(s-1-S) as bf16x2
__device__ __forceinline__ u32 scale_pair(u32 s, int shift) {
    u32 b = (s + 126u - (u32)shift) << 7;
    return b | (b << 16);
}

// this thread's 32 activations at K offset `off` as 16 bf16x2 registers (zeros for a missing row)
__device__ __forceinline__ void load_x(u32* xv, const void* X, long long row, int off, bool ok) {
    if (!ok) {
#pragma unroll
        for (int i = 0; i < 16; ++i) xv[i] = 0u;
        return;
    }
#if XT == 0
    const uint4* p = (const uint4*)((const unsigned short*)X + row + off);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        uint4 v = __ldg(p + i);
        xv[4 * i] = v.x; xv[4 * i + 1] = v.y; xv[4 * i + 2] = v.z; xv[4 * i + 3] = v.w;
    }
#else
    const float4* p = (const float4*)((const float*)X + row + off);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        float4 v = __ldg(p + i);
        xv[2 * i] = pack_bf16(v.x, v.y);
        xv[2 * i + 1] = pack_bf16(v.z, v.w);
    }
#endif
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(smem_addr(dst)), "l"(src));
}

__device__ __forceinline__ u32 word(const uint4& q, int i) {
    return i == 0 ? q.x : i == 1 ? q.y : i == 2 ? q.z : q.w;
}

// acc[mt] += the 32-code blocks q[mt][row g, row g+8] (scale bytes s) times the activations xv
__device__ __forceinline__ void block_mma(float (*acc)[4], const uint4 (*q)[2], const u32 (*s)[2], const u32* xv,
                                          int shift) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        u32 ma = scale_pair(s[mt][0], shift), mb = scale_pair(s[mt][1], shift);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 wa = word(q[mt][0], i), wb = word(q[mt][1], i);
            u32 x01 = xv[4 * i], x23 = xv[4 * i + 1], x45 = xv[4 * i + 2], x67 = xv[4 * i + 3];
            // codes (0,4) and (1,5) of each word, then (2,6) and (3,7); the activations likewise
            mma(acc[mt], bf16x2_mul(e2m1_pair<0>(wa), ma), bf16x2_mul(e2m1_pair<0>(wb), mb),
                bf16x2_mul(e2m1_pair<1>(wa), ma), bf16x2_mul(e2m1_pair<1>(wb), mb),
                prmt(x01, x45, 0x5410u), prmt(x01, x45, 0x7632u));
            mma(acc[mt], bf16x2_mul(e2m1_pair<2>(wa), ma), bf16x2_mul(e2m1_pair<2>(wb), mb),
                bf16x2_mul(e2m1_pair<3>(wa), ma), bf16x2_mul(e2m1_pair<3>(wb), mb),
                prmt(x23, x67, 0x5410u), prmt(x23, x67, 0x7632u));
        }
    }
}

#define PIECES (2 * MT * 2)          // 16-byte weight loads per thread and chunk: projections × MT × 2 rows

extern "C" __global__ void __launch_bounds__(32 * WK)
grouped_fp4_mma(const void* X, const int* ROWS, const int* TILE_E, const int* TILE_S, const int* TILE_T,
                const u8* WP1, const u8* SP1, const u8* WP3, const u8* SP3, const float* ROUTE, void* Y,
                int N, int K, int ew_stride, int es_stride, int stride_x, double limit_d, int shift, int flags) {
    // each warp's weight bytes stream through STAGES buffers of shared memory (cp.async; a thread
    // reads back only what it copied, so no barrier is needed), STAGES - 1 runs ahead of the MMAs;
    // a run is CK consecutive chunks of 128 inputs, copied back to back (CK·64 bytes of each weight row)
    __shared__ uint4 wbuf[STAGES][WK][CK][PIECES][32];
    const bool gather = flags & 1, swiglu = flags & 2, table = flags & 4;
    pdl_wait_then_release();       // the tile table and the activations come from the kernels before
    const int tile = blockIdx.x;
    const int e = TILE_E[tile];
    if (e < 0) return;
    const int start = TILE_S[tile], cnt = TILE_T[tile] - start;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int n0 = blockIdx.y * (16 * MT);
    const u8 *w[2], *sc[2];
    if (table) {
        w[0] = (const u8*)((const long long*)WP1)[e]; sc[0] = (const u8*)((const long long*)SP1)[e];
        w[1] = (const u8*)((const long long*)WP3)[e]; sc[1] = (const u8*)((const long long*)SP3)[e];
    } else {
        w[0] = WP1 + (long long)e * ew_stride; sc[0] = SP1 + (long long)e * es_stride;
        w[1] = WP3 + (long long)e * ew_stride; sc[1] = SP3 + (long long)e * es_stride;
    }
    const int np = swiglu ? 2 : 1;
    const int kw = K / 2, ks = K / 32, runs = K / (128 * CK);
    const int mine = runs > warp ? (runs - warp + WK - 1) / WK : 0;         // runs warp, warp + WK, ...
    const bool tok_ok = g < cnt;
    long long xrow = 0;
    if (tok_ok) xrow = (long long)(gather ? ROWS[start + g] : start + g) * stride_x;

    float acc[2][MT][4];
#pragma unroll
    for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[p][mt][i] = 0.f;

    // the j-th run of this warp: its weight pieces into stage j % STAGES (an empty group past the end)
    auto issue = [&](int j) {
        if (j < mine) {
#pragma unroll
            for (int c = 0; c < CK; ++c) {
                const int off = ((warp + j * WK) * CK + c) * 128 + tq * 32;
#pragma unroll
                for (int p = 0; p < 2; ++p) {
                    if (p >= np) break;
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
                            const long long row = n0 + mt * 16 + g + 8 * h;
                            cp_async16(&wbuf[j % STAGES][warp][c][(p * MT + mt) * 2 + h][lane],
                                       w[p] + row * kw + off / 2);
                        }
                }
            }
        }
        asm volatile("cp.async.commit_group;");
    };
    // the u-th chunk of this warp (chunk u % CK of run u / CK): its scale bytes and activations, into registers
    auto fetch = [&](int u, u32 (*s)[MT][2], u32* xv) {
        if (u >= mine * CK) return;
        const int off = ((warp + (u / CK) * WK) * CK + u % CK) * 128 + tq * 32;
#pragma unroll
        for (int p = 0; p < 2; ++p) {
            if (p >= np) break;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    s[p][mt][h] = sc[p][(long long)(n0 + mt * 16 + g + 8 * h) * ks + off / 32];
        }
        load_x(xv, X, xrow, off, tok_ok);
    };

#pragma unroll
    for (int j = 0; j < STAGES - 1; ++j) issue(j);
    u32 s_cur[2][MT][2], s_next[2][MT][2], x_cur[16], x_next[16];
    fetch(0, s_cur, x_cur);
    for (int j = 0; j < mine; ++j) {
        issue(j + STAGES - 1);
        asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 1));
#pragma unroll
        for (int c = 0; c < CK; ++c) {
            fetch(j * CK + c + 1, s_next, x_next);
#pragma unroll
            for (int p = 0; p < 2; ++p) {
                if (p >= np) break;
                uint4 q[MT][2];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) q[mt][h] = wbuf[j % STAGES][warp][c][(p * MT + mt) * 2 + h][lane];
                block_mma(acc[p], q, s_cur[p], x_cur, shift);
            }
#pragma unroll
            for (int p = 0; p < 2; ++p)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    s_cur[p][mt][0] = s_next[p][mt][0];
                    s_cur[p][mt][1] = s_next[p][mt][1];
                }
#pragma unroll
            for (int i = 0; i < 16; ++i) x_cur[i] = x_next[i];
        }
    }
    float (*acc1)[4] = acc[0];
    float (*acc3)[4] = acc[1];

#if WK > 1
    // the warps' partial tiles, in the weight buffers once every warp is done with them
    asm volatile("cp.async.wait_all;");
    __syncthreads();
    float (*red)[32][8 * MT] = reinterpret_cast<float (*)[32][8 * MT]>(&wbuf[0][0][0][0][0]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            red[warp][lane][mt * 8 + i] = acc1[mt][i];
            red[warp][lane][mt * 8 + 4 + i] = acc3[mt][i];
        }
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float a = red[0][lane][mt * 8 + i], b = red[0][lane][mt * 8 + 4 + i];
            for (int w = 1; w < WK; ++w) { a += red[w][lane][mt * 8 + i]; b += red[w][lane][mt * 8 + 4 + i]; }
            acc1[mt][i] = a; acc3[mt][i] = b;
        }
#endif
    const float unshift = __int_as_float((127 + shift) << 23);
    const float limit = (float)limit_d;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int token = 2 * tq + (i & 1);        // c0/c2: column 2t, c1/c3: 2t+1
            if (token >= cnt) continue;
            const int r = start + token;
            const int n = n0 + mt * 16 + g + 8 * (i >> 1);
            float out;
            if (swiglu) {
                float gate = round_out(acc1[mt][i] * unshift), up = round_out(acc3[mt][i] * unshift);
                if (limit > 0.f) { up = fminf(fmaxf(up, -limit), limit); gate = fminf(gate, limit); }
                out = ROUTE[r] * (gate / (1.f + __expf(-gate)) * up);
            } else {
                out = acc1[mt][i] * unshift;
            }
            store_out(Y, (long long)r * N + n, out);
        }
}
"""

DEFAULT_CONFIG = {"MT": 2, "WK": 2, "STAGES": 3, "CK": 1}    # what a config leaves out
FEW_PAIRS = 8              # at most this many sorted rows: one token's experts
MANY_PAIRS = 64            # beyond this the w1/w3 launch takes two 16-row tiles a warp


def config(pairs: int, gated: bool) -> dict:
    """The launch's tiles for `pairs` sorted rows (`gated`: the w1/w3 launch with its SwiGLU): the
    fastest of `benchmarks/qgemm_kernels.py --sweep --families mma` at 1, 8 and 64 tokens at
    V4-Flash's width (H100; docs/training-log.md, 2026-12-06). Three buffers a warp keep more weight
    bytes in flight than two."""
    if pairs <= FEW_PAIRS:
        return {"MT": 1, "WK": 4, "STAGES": 3, "CK": 1}
    if gated:
        return {"MT": 1 if pairs <= MANY_PAIRS else 2, "WK": 4, "STAGES": 3, "CK": 1}
    return {"MT": 2, "WK": 2, "STAGES": 3, "CK": 1}


CONFIG_KEYS = ("MT", "WK", "STAGES", "CK")


def enabled() -> bool:
    """Whether decode-sized grouped FP4 launches may take this kernel on CUDA: yes unless
    `HYBRIDKV_FP4_MMA=0` (then the CUDA-core one-row kernel and Triton's tiles, as before)."""
    return os.environ.get("HYBRIDKV_FP4_MMA", "1") != "0"


def usable(x: torch.Tensor, n_out: tuple[int, ...], k_in: tuple[int, ...]) -> bool:
    """Whether this kernel takes activations x against weights of these output and input widths:
    CUDA with bf16 MMA (sm_80 and newer) and torch's NVRTC loader, bf16 or float32 activations,
    widths multiples of 32 and 128."""
    return (enabled() and x.is_cuda and x.dtype in nvrtc.DTYPES_X
            and nvrtc.available(x.device.index, (8, 0), "the routed experts at decode")
            and all(n % 32 == 0 for n in n_out) and all(k % 128 == 0 for k in k_in))


def scale_shift(max_scale_byte: int) -> int:
    """S of the module docstring: how far the bf16 multipliers are lowered so that 2^(s-1-S) stays
    a finite bf16 for the largest scale byte of the weights."""
    return max(0, int(max_scale_byte) - 128)


SHARED_MAX = 48 * 1024      # a block's static shared memory


def shared_bytes(mt: int, wk: int, stages: int, ck: int) -> int:
    """The shared memory of a variant: its weight buffers, STAGES·WK·CK·MT·2 KiB."""
    return stages * wk * ck * mt * 2048


def source(x_dtype: torch.dtype, y_dtype: torch.dtype, mt: int, wk: int, stages: int, pdl: bool = False,
           ck: int = 1) -> str:
    """The CUDA C++ of one variant, as compiled at first use."""
    return nvrtc.source(SOURCE, x_dtype, y_dtype, MT=mt, WK=wk, STAGES=stages, CK=ck, PDL=int(pdl))


def grouped_fp4_mma(x: torch.Tensor, rows: torch.Tensor | None, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                    w1: tuple[torch.Tensor, torch.Tensor], n: int, y: torch.Tensor,
                    w3: tuple[torch.Tensor, torch.Tensor] | None, route: torch.Tensor | None, limit: float,
                    strides: tuple[int, int], table: bool, shift: int, config: dict) -> torch.Tensor:
    """The launch behind `triton.grouped_fp4` for tiles of at most `TILE_ROWS` rows (the caller
    checked the layout). config: MT (16-row weight tiles per warp, 1 or 2), WK (warps splitting K),
    STAGES (shared-memory buffers each warp streams its weight bytes through), CK (chunks of 128
    inputs a buffer holds: each weight row is read CK·64 contiguous bytes at a time)."""
    k = x.shape[-1]
    mt, wk, stages, ck = (int(config.get(name, DEFAULT_CONFIG[name])) for name in CONFIG_KEYS)
    if x.stride(-1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16 or k % (128 * ck) or n % (16 * mt):
        raise ValueError(f"grouped FP4 MMA: x [{x.shape[0]}, {k}] (stride {x.stride(0)}), N {n}, MT {mt}, CK {ck}: "
                         "K must be a multiple of 128·CK, N of 16·MT, x rows 16-byte aligned")
    if (mt not in (1, 2) or not 1 <= wk <= 8 or stages < 2 or ck not in (1, 2, 4)
            or shared_bytes(mt, wk, stages, ck) > SHARED_MAX):
        raise ValueError(f"grouped FP4 MMA: MT {mt} (1 or 2), WK {wk} (1..8), STAGES {stages} (≥ 2), CK {ck} (1, 2 "
                         "or 4): the weight buffers (STAGES·WK·CK·MT·2 KiB) must fit in 48 KiB of shared memory")
    if x.dtype not in nvrtc.DTYPES_X or y.dtype not in nvrtc.DTYPES_Y:
        raise ValueError(f"grouped FP4 MMA: activations {x.dtype} / output {y.dtype} not supported")
    if not 0 <= shift < 128:
        raise ValueError(f"grouped FP4 MMA: scale shift {shift} out of range")
    variant = (x.dtype, y.dtype, mt, wk, stages, pdl.enabled(x), ck)
    kern = nvrtc.kernel(x.device, "grouped_fp4_mma", variant, lambda: source(*variant))
    swiglu = w3 is not None
    flags = (1 if rows is not None else 0) | (2 if swiglu else 0) | (4 if table else 0)
    w3 = w3 if swiglu else w1
    nvrtc.launch(kern, x.device, (tiles[0].shape[0], n // (16 * mt), 1), (32 * wk, 1, 1),
                 [x, rows if rows is not None else tiles[0], tiles[0], tiles[1], tiles[2], w1[0], w1[1], w3[0], w3[1],
                  route if swiglu else x, y, int(n), int(k), int(strides[0]), int(strides[1]), int(x.stride(0)),
                  float(limit), int(shift), int(flags)], pdl=variant[5])
    return y
