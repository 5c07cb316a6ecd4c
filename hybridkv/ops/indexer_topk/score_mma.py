"""The Lightning Indexer's decode scoring over packed FP4 keys on the integer tensor cores, in CUDA C++
compiled at first use (NVRTC, through torch): the same launch contract as the Triton
`score_decode_kernel` (one token × a chunk of its keys per block, the same chunks; each score's
order-preserving key and each tile's largest), which it replaces, where `enabled`, on sm_89 and newer
where the pool holds 128-dim FP4 keys and the queries lie on the FP4 grid (V4's and V4.1's indexers,
after their FP4 round trip).

What bounds the Triton kernel is not memory but the work of each key's 128 codes: widened to fp16,
passed through shared memory into the MMA's operand layout, multiplied by each 32-block's scale.
FP4 values on a common power-of-two scale are small integers (E2M1 × 2 is 0..12), so here both
operands are int8 and the products and their sums are exact (`mma.sync.m16n8k32.s8`, int32
accumulation; Hopper runs it natively, where its FP8 `mma.sync` is emulated through fp16):

- The keys are the MMA's A operand (16 keys × 8 heads × 32 inputs), the queries its B operand. The
  MMA only needs the same permutation of its k index in both, so thread (g, t) of a quad takes the
  32 codes of block t of keys g and g + 8 (one 16-byte load each) and the queries' inputs of block
  t: every code a thread holds shares one scale.
- Four codes (a half-word's nibbles) become four int8 with two byte permutes through an 8-byte
  table of E2M1's magnitudes times 2^(4−k), k the block's binades below the key's largest scale (the
  table word shifted right by k): a set sign bit selects a zero byte, the flipped selector picks the
  negative codes' magnitudes, negated bytewise. One accumulator per head sums the whole key.
- The block's warps convert the token's queries into shared memory first (each head scaled by the
  power of two that brings its largest value into [64, 128)); each thread then holds its 64 operand
  words in registers. A warp scores `SUBTILES` subtiles of 16 keys an iteration, the next ones'
  loads in flight.
- Exactness needs every block within 3 binades of its key's (and head's) largest. A subtile with a
  key that is not (`__any_sync`) is summed block by block instead: four MMA passes, block b's codes
  at their own scale, each pass's exact sum times 2^(s_b − smax) in float32; a token with a query head
  that is not takes that path for every subtile, with each head block at its own scale.
- The ReLU-weighted head sum is taken on the accumulators (converted, clamped, multiplied into the
  head's weight times its power of two; two shuffles in the quad); the key's largest scale
  multiplies the sum.

Every score is computed by the same instructions at the same MMA row whatever the chunking (a
subtile of 16 keys always starts at a multiple of 16), so a token's scores never depend on its
batch. The dot products are exact; only the float32 head sum's order differs from the reference.
"""

from __future__ import annotations

import os

import torch

from hybridkv.ops import pdl
from hybridkv.ops.qgemm import nvrtc

WARPS = 4          # warps a block; each takes groups of 64 consecutive keys in turn
MAX_HEADS = 64     # query heads held as operands in registers (8 per MMA)
SUBTILE = 16       # keys an MMA's rows cover: a pool block's entries must be a multiple
MIN_BLOCKS = 2     # blocks an SM must hold at once (caps the registers a thread)
SUBTILES = 2       # subtiles of 16 keys a warp scores per iteration (sharing its loop's overhead; 1 and 4
                   # were slower at 1M, B=8 on an H100)

SOURCE = r"""
#define NT ((NH + 7) / 8)
#define FULL 0xffffffffu

// c = A·B + c, or (first) c = A·B: int8 operands, int32 accumulation (exact)
__device__ __forceinline__ void mma_acc(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_first(int* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%10,%10,%10,%10};"
                 : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(0));
}

// 2^e as a float (0 below the normal range)
__device__ __forceinline__ float pow2(int e) { return e > -127 ? __uint_as_float((u32)(e + 127) << 23) : 0.0f; }

// E2M1's magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 times 2^(4-k) as int8 (bytes 0-3 in T0_LO, 4-7 in T0_HI at
// k = 0): a 32-block whose scale lies k <= 3 binades below its key's largest. Every k = 0 byte is a
// multiple of 8, so shifting the words right by k shifts each byte alone.
#define T0_LO 0x18100800u
#define T0_HI 0x60403020u

// the four codes in the nibbles of sel's low half-word (bit 3 the sign) -> four int8: a code's magnitude
// where its sign is clear (a set sign bit picks the sign-replicated byte: 0), then the negative codes'
// magnitudes (selected by the flipped selector `nsel`), negated bytewise: (0x80 - x) ^ 0x80 = -x
__device__ __forceinline__ u32 codes_s8(u32 sel, u32 nsel, u32 lo, u32 hi) {
    const u32 pos = prmt(lo, hi, sel), neg = prmt(lo, hi, nsel);
    return pos | ((0x80808080u - neg) ^ 0x80808080u);
}

// four floats (exact integers in [-127, 127]) -> four int8 in a word, the first in the low byte
__device__ __forceinline__ u32 pack_s8(float a, float b, float c, float d) {
    return ((u32)__float2int_rn(a) & 255u) | (((u32)__float2int_rn(b) & 255u) << 8)
         | (((u32)__float2int_rn(c) & 255u) << 16) | ((u32)__float2int_rn(d) << 24);
}

// float32 -> uint32 whose unsigned order is the float order (-0 and +0 equal)
__device__ __forceinline__ u32 ordered_key(float sc) {
    const u32 u = __float_as_uint(sc + 0.0f);
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u32 umax(u32 a, u32 b) { return a > b ? a : b; }

// this thread's 32 query inputs (head h, inputs 32 tq ..) as floats
__device__ __forceinline__ void load_q(float* v, const void* Q, long long off) {
#if XT == 0
    const uint4* p = (const uint4*)((const unsigned short*)Q + off);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint4 u = __ldg(p + i);
        const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[8 * i + 2 * k] = __uint_as_float(w[k] << 16);
            v[8 * i + 2 * k + 1] = __uint_as_float(w[k] & 0xFFFF0000u);
        }
    }
#else
    const float4* p = (const float4*)((const float*)Q + off);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 u = __ldg(p + i);
        v[4 * i] = u.x; v[4 * i + 1] = u.y; v[4 * i + 2] = u.z; v[4 * i + 3] = u.w;
    }
#endif
}

__device__ __forceinline__ void load_head(float* v, const void* Q, long long off, bool ok) {
    if (ok) {
        load_q(v, Q, off);
    } else {
#pragma unroll
        for (int i = 0; i < 32; ++i) v[i] = 0.0f;
    }
}

__device__ __forceinline__ float load_w(const void* W, long long i) {
#if WT == 0
    return __uint_as_float(((u32)((const unsigned short*)W)[i]) << 16);
#else
    return ((const float*)W)[i];
#endif
}

// the exponent x with |v| * 2^x in [64, 128) for the largest |v| = amax (biased exponent e: x = 133 - e)
__device__ __forceinline__ int int8_shift(float amax) {
    const int e = (int)(__float_as_uint(amax) >> 23);
    return 133 - (e < 8 ? 8 : e);
}

// this thread's 32 codes of block tq of keys g and g + 8 (16 bytes each) and their scale words, for the
// MT subtiles of 16 keys from j (each subtile's keys lie in one pool block); rows past the end reload
// the last key (computed, never stored)
__device__ __forceinline__ void fetch_keys(const u32* POOL, const int* bt, int j, int end, int g, int tq,
                                           u32 (*w)[2][4], u32 (*s)[2]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int jm = j + 16 * mt < end ? j + 16 * mt : end - 1;
        const u32* block = POOL + (long long)bt[(u32)jm / EPB] * (EPB * 17);
        const u32 first = (u32)jm % EPB - (u32)jm % 16u;      // the subtile's first entry in its block
        const int last = end - 1 - (jm - jm % 16);             // the subtile's last valid row
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = g + 8 * r < last ? g + 8 * r : last;
            const u32 ent = first + (u32)row;
            const uint4 u = __ldg((const uint4*)(block + ent * 16u + 4u * (u32)tq));
            w[mt][r][0] = u.x; w[mt][r][1] = u.y; w[mt][r][2] = u.z; w[mt][r][3] = u.w;
            s[mt][r] = __ldg(block + EPB * 16 + ent);
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * WARPS, MIN_BLOCKS)
indexer_score_fp4(const void* Q, int sq_t, int sq_h, const void* W, int sw_t, const u32* POOL, const int* BT,
                  int s_bt, const int* TOK_REQ, const int* VIS, u32* KEYS, int s_keys, u32* TMAX, int s_tmax,
                  int chunk) {
    pdl_wait_then_release();
    const int t = blockIdx.x;
    const int n_start = blockIdx.y * chunk;
    int vis = VIS[t];
#if RATIO > 0
    vis = (vis + 1) / RATIO;
#endif
    if (n_start >= vis) return;
    const int end = n_start + chunk < vis ? n_start + chunk : vis;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;
    const int* bt = BT + (long long)TOK_REQ[t] * s_bt;

    // The queries as int8 B operands, converted by the block's warps (warp w: heads 8n + g of n = w,
    // w + WARPS, ...) into shared memory: lane (g, tq) holds head 8n + g, inputs 32 tq .. 32 tq + 31 (its
    // block tq), four to a word. Each head times 2^x_h, its largest value brought into [64, 128): exact for
    // FP4-grid queries whose blocks lie within 3 binades of the head's largest. Where a head of the token
    // is not exact so, every head's block b is scaled on its own (2^x_hb, exact for any FP4-grid query)
    // and every subtile is summed block by block, each head block times 2^(x_h - x_hb) (`block_f`).
    __shared__ u32 q_words[8 * NT][32];
    __shared__ float head_w[8 * NT], block_f[8 * NT][4];
    constexpr int PER_WARP = (NT + WARPS - 1) / WARPS;
    float v[PER_WARP][32];
    int xh[PER_WARP], xb[PER_WARP];
    bool exact = true;
#pragma unroll
    for (int k = 0; k < PER_WARP; ++k) {
        const int n = warp + WARPS * k, h = 8 * n + g;
        load_head(v[k], Q, (long long)t * sq_t + (long long)h * sq_h + 32 * tq, n < NT && h < NH);
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[k][i]));
        xb[k] = int8_shift(amax);
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(FULL, amax, 2));
        xh[k] = int8_shift(amax);
        const float f = pow2(xh[k]);
#pragma unroll
        for (int i = 0; i < 32; ++i) exact &= rintf(v[k][i] * f) == v[k][i] * f;
    }
    const bool blockwise_q = !__syncthreads_and(exact);
#pragma unroll
    for (int k = 0; k < PER_WARP; ++k) {
        const int n = warp + WARPS * k, h = 8 * n + g;
        if (n < NT) {
            const float f = pow2(blockwise_q ? xb[k] : xh[k]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                q_words[8 * n + i][lane] = pack_s8(v[k][4 * i] * f, v[k][4 * i + 1] * f, v[k][4 * i + 2] * f,
                                                   v[k][4 * i + 3] * f);
            block_f[h][tq] = blockwise_q ? pow2(xh[k] - xb[k]) : 1.0f;
            if (tq == 0) head_w[h] = h < NH ? load_w(W, (long long)t * sw_t + h) * pow2(-xh[k]) : 0.0f;
        }
    }
    __syncthreads();
    u32 qf[NT][8];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 8; ++i) qf[n][i] = q_words[8 * n + i][lane];
    const float2* wpair = (const float2*)head_w + tq;       // heads 8n + 2tq and 8n + 2tq + 1: wpair[4n]

    // iterations of MT subtiles of 16 keys, in groups of 64 consecutive keys: group warp, warp + WARPS, ...
    int j0 = n_start + 64 * warp;
    if (j0 >= end) return;
    u32 cw[MT][2][4], cs[MT][2], nw[MT][2][4], ns[MT][2];
    u32* keys = KEYS + (long long)t * s_keys;
    fetch_keys(POOL, bt, j0, end, g, tq, cw, cs);
    u32 tile_max = 0u;

    // a subtile's ReLU-weighted head sums of rows g (s0) and g + 8 (s1) from its dot products
    // (`dot[n][i]`: accumulator element i of head tile n, in the MMA's layout), then its key stores and
    // its share of the tile maxima. (Not a generic lambda: NVRTC compiles those as host functions.)
    auto finish = [&](int jm, const float (&dot)[NT][4], u32 smax0, u32 smax1) {
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            const float2 wn = wpair[4 * n];
            s0 = fmaf(fmaxf(dot[n][0], 0.0f), wn.x, s0);
            s0 = fmaf(fmaxf(dot[n][1], 0.0f), wn.y, s0);
            s1 = fmaf(fmaxf(dot[n][2], 0.0f), wn.x, s1);
            s1 = fmaf(fmaxf(dot[n][3], 0.0f), wn.y, s1);
        }
        s0 += __shfl_xor_sync(FULL, s0, 1);
        s1 += __shfl_xor_sync(FULL, s1, 1);
        s0 += __shfl_xor_sync(FULL, s0, 2);
        s1 += __shfl_xor_sync(FULL, s1, 2);
        // a key's operands are its values times 2^(131 - smax)
        const int ja = jm + g, jb = ja + 8;
        const u32 ka = ja < end ? ordered_key(s0 * __uint_as_float(smax0 << 23) * 0.0625f) : 0u;
        const u32 kb = jb < end ? ordered_key(s1 * __uint_as_float(smax1 << 23) * 0.0625f) : 0u;
        if (tq == 0 && ja < end) keys[ja] = ka;
        if (tq == 1 && jb < end) keys[jb] = kb;
        u32 m = umax(ka, kb);
        m = umax(m, __shfl_xor_sync(FULL, m, 4));
        m = umax(m, __shfl_xor_sync(FULL, m, 8));
        m = umax(m, __shfl_xor_sync(FULL, m, 16));
        tile_max = umax(tile_max, m);
        // the tile's last subtile, or the chunk's (a subtile past the end stores nothing)
        if (jm < end && ((jm + 16) % TILE_N == 0 || jm + 16 >= end)) {
            if (lane == 0) TMAX[(long long)t * s_tmax + jm / TILE_N] = tile_max;
            tile_max = 0u;
        }
    };

    while (true) {
        int jn = j0 + 16 * MT;
        if ((jn & 63) == 0) jn += 64 * (WARPS - 1);
        const bool more = jn < end;
        if (more) fetch_keys(POOL, bt, jn, end, g, tq, nw, ns);

        u32 smax[MT][2], k_own[MT][2];
        bool wide = blockwise_q;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 s = cs[mt][r];
                const u32 b0 = s & 255u, b1 = (s >> 8) & 255u, b2 = (s >> 16) & 255u, b3 = s >> 24;
                smax[mt][r] = umax(umax(b0, b1), umax(b2, b3));
                k_own[mt][r] = smax[mt][r] - ((s >> (8 * tq)) & 255u);
                wide = wide || k_own[mt][r] > 3u;
            }
        if (!__any_sync(FULL, wide)) {
            int acc[MT][NT][4];
#pragma unroll
            for (int s = 0; s < 4; ++s)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const u32 w0 = cw[mt][0][s], w1 = cw[mt][1][s], x0 = w0 ^ 0x88888888u, x1 = w1 ^ 0x88888888u;
                    const u32 lo0 = T0_LO >> k_own[mt][0], hi0 = T0_HI >> k_own[mt][0];
                    const u32 lo1 = T0_LO >> k_own[mt][1], hi1 = T0_HI >> k_own[mt][1];
                    const u32 a0 = codes_s8(w0, x0, lo0, hi0), a2 = codes_s8(w0 >> 16, x0 >> 16, lo0, hi0);
                    const u32 a1 = codes_s8(w1, x1, lo1, hi1), a3 = codes_s8(w1 >> 16, x1 >> 16, lo1, hi1);
#pragma unroll
                    for (int n = 0; n < NT; ++n) {
                        if (s == 0) mma_first(acc[mt][n], a0, a1, a2, a3, qf[n][0], qf[n][1]);
                        else mma_acc(acc[mt][n], a0, a1, a2, a3, qf[n][2 * s], qf[n][2 * s + 1]);
                    }
                }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float dot[NT][4];
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) dot[n][i] = (float)acc[mt][n][i];
                finish(j0 + 16 * mt, dot, smax[mt][0], smax[mt][1]);
            }
        } else {
            // block by block: block b's codes (held by the threads tq == b) at their own scale, the others
            // zero; each block's exact sum times its scale relative to the key's largest (2^(s_b - smax + 3))
            // and the head block's relative to the head's
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                float sc[2][NT][2];
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int n = 0; n < NT; ++n) sc[r][n][0] = sc[r][n][1] = 0.0f;
#pragma unroll 1
                for (int b = 0; b < 4; ++b) {
                    const bool mine = tq == b;
                    int acc[NT][4];
#pragma unroll
                    for (int s = 0; s < 4; ++s) {
                        const u32 w0 = mine ? cw[mt][0][s] : 0u, w1 = mine ? cw[mt][1][s] : 0u;
                        const u32 x0 = w0 ^ 0x88888888u, x1 = w1 ^ 0x88888888u;
                        const u32 lo = T0_LO >> 3, hi = T0_HI >> 3;
                        const u32 a0 = codes_s8(w0, x0, lo, hi), a2 = codes_s8(w0 >> 16, x0 >> 16, lo, hi);
                        const u32 a1 = codes_s8(w1, x1, lo, hi), a3 = codes_s8(w1 >> 16, x1 >> 16, lo, hi);
#pragma unroll
                        for (int n = 0; n < NT; ++n) {
                            if (s == 0) mma_first(acc[n], a0, a1, a2, a3, qf[n][0], qf[n][1]);
                            else mma_acc(acc[n], a0, a1, a2, a3, qf[n][2 * s], qf[n][2 * s + 1]);
                        }
                    }
                    float rf[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        rf[r] = pow2((int)((cs[mt][r] >> (8 * b)) & 255u) - (int)smax[mt][r] + 3);
#pragma unroll
                    for (int n = 0; n < NT; ++n)
#pragma unroll
                        for (int i = 0; i < 4; ++i) {
                            const float cf = block_f[8 * n + 2 * tq + (i & 1)][b];
                            sc[i >> 1][n][i & 1] = fmaf((float)acc[n][i], rf[i >> 1] * cf, sc[i >> 1][n][i & 1]);
                        }
                }
                float dot[NT][4];
#pragma unroll
                for (int n = 0; n < NT; ++n)
#pragma unroll
                    for (int i = 0; i < 4; ++i) dot[n][i] = sc[i >> 1][n][i & 1];
                finish(j0 + 16 * mt, dot, smax[mt][0], smax[mt][1]);
            }
        }
        if (!more) break;
        j0 = jn;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                cs[mt][r] = ns[mt][r];
#pragma unroll
                for (int i = 0; i < 4; ++i) cw[mt][r][i] = nw[mt][r][i];
            }
    }
}
"""

_W_DTYPES = {torch.bfloat16: 0, torch.float32: 1}


def enabled() -> bool:
    """Whether the decode scoring of FP4 keys and queries takes this kernel on CUDA: only with
    `HYBRIDKV_INDEXER_MMA=1`. Off by default: on an H100 it is 14 % faster at 1M, B=8 and 3-8 %
    slower at 128K and at B=1 (docs/training-log.md, 2026-12-07); choosing by size would make a
    token's selection depend on its batch."""
    flag = os.environ.get("HYBRIDKV_INDEXER_MMA", "0")
    if flag not in ("0", "1"):
        raise ValueError(f"HYBRIDKV_INDEXER_MMA={flag!r}: 0 or 1")
    return flag == "1"


def usable(q: torch.Tensor, weights: torch.Tensor, head_dim: int, words: bool, epb: int, tables: torch.Tensor,
           token_req: torch.Tensor, vis: torch.Tensor) -> bool:
    """Whether this kernel scores q [T, H, 128] (on the FP4 grid: the caller's promise) against a pool
    of FP4 keys read as int32 words (`words`, 68-B keys in the block layout): CUDA on sm_89 or newer
    with torch's NVRTC loader, at most `MAX_HEADS` heads, pool blocks of a multiple of 16 entries,
    bf16 or float32 queries and weights, int32 tables."""
    return (enabled() and q.is_cuda and words and head_dim == 128 and q.shape[-1] == 128
            and 0 < q.shape[1] <= MAX_HEADS and epb % SUBTILE == 0
            and q.dtype in (torch.bfloat16, torch.float32) and weights.dtype in _W_DTYPES
            and all(x.dtype == torch.int32 for x in (tables, token_req, vis))
            and nvrtc.available(q.device.index, (8, 9), "the indexer's FP4 decode scoring"))


def source(q_dtype: torch.dtype, w_dtype: torch.dtype, heads: int, epb: int, ratio: int, tile_n: int,
           use_pdl: bool) -> str:
    """The CUDA C++ of one variant, as compiled at first use."""
    return nvrtc.source(SOURCE, q_dtype, torch.float32, WT=_W_DTYPES[w_dtype], NH=heads, EPB=epb, RATIO=ratio,
                        TILE_N=tile_n, WARPS=WARPS, MIN_BLOCKS=MIN_BLOCKS, MT=SUBTILES, PDL=int(use_pdl))


def score_decode(q: torch.Tensor, weights: torch.Tensor, pool_words: torch.Tensor, tables: torch.Tensor,
                 token_req: torch.Tensor, vis: torch.Tensor, keys: torch.Tensor, tmax: torch.Tensor, n_max: int,
                 chunk: int, tile_n: int, epb: int, ratio: int) -> None:
    """The decode scoring launches (where `usable`): the queries' operands once per token, then token
    t's order-preserving score keys of its visible entries into keys[t], the largest of every `tile_n`
    of them into tmax[t]. `vis`: visible counts, or with `ratio` > 0 positions ((p + 1) // ratio
    entries visible). `chunk`: keys per block, a multiple of 64."""
    if chunk % 64 or 64 % tile_n:
        raise ValueError(f"indexer scoring: chunk {chunk} must be a multiple of 64 and tile {tile_n} divide 64")
    if q.stride(-1) != 1 or q.stride(1) % 8 or q.stride(0) % 8 or q.data_ptr() % 16:    # 16-byte query loads
        q = q.contiguous()
    if weights.stride(-1) != 1:
        weights = weights.contiguous()
    t, h, _ = q.shape
    variant = (q.dtype, weights.dtype, h, epb, ratio, tile_n, pdl.enabled(q))
    kern = nvrtc.kernel(q.device, "indexer_score_fp4", variant, lambda: source(*variant))
    nvrtc.launch(kern, q.device, (t, -(-n_max // chunk), 1), (32 * WARPS, 1, 1),
                 [q, int(q.stride(0)), int(q.stride(1)), weights, int(weights.stride(0)), pool_words, tables,
                  int(tables.stride(0)), token_req, vis, keys, int(keys.stride(0)), tmax, int(tmax.stride(0)),
                  int(chunk)], pdl=variant[-1])
