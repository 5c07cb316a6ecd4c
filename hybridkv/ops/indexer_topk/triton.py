"""Triton kernels for the Lightning Indexer: scores of every visible compressed entry, then an
exact causal top-k, returned in ascending entry order (what attention consumes). Two stages:

1. Scoring, split along the entry axis so that a long context fills the GPU. Decode tokens use
   `score_decode_kernel` (one token × a chunk of its keys per program, the keys as the rows of the
   MMA, so the sum over heads stays inside a warp); prefill chunks use `score_tile_kernel` (a tile
   of one request's tokens × a chunk of keys, tokens·heads as rows). Both write an
   order-preserving uint32 key per score and, as the first selection stage, the largest key of
   every tile of consecutive entries (64, or 32 or 16 where a row has few tiles per selected
   entry: `maxima_tile`).
2. Selection (`hybridkv.ops.indexer_topk.select`): exact top-k from the keys and the tile maxima,
   in one program per token (`select_kernel`), or for few tokens with long rows in two launches
   that gather each token's candidates in several programs first. Integer keys and fixed orders:
   the result is exact (by score) and deterministic, and a token's result never depends on its
   batch (each score is computed by one MMA row whatever the chunking, and either selection gives
   the same entries).

FP4 keys (68 B: 64 code bytes + 4 ue8m0 scales, in the block layout of `hybridkv.ops.kv_formats`:
a block's codes first, then its scales) are read as int32 words, 16 code words and a scale word. Four codes of a word
become e4m3 bytes at once (sign to bit 7, e1 e0 m to bits 4..2: the e4m3 value is the E2M1 value
× 2⁻⁶, E2M1's subnormal 0.5 landing on an e4m3 subnormal), which the hardware widens to fp16; an
fp16 multiply by 2^(s−smax+6) brings each 32-block to the row's largest scale, and the MMA runs in
fp16 on queries pre-scaled per head; the powers of two come back after the ReLU.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import is_deterministic
from hybridkv.ops.indexer_topk import score_mma
from hybridkv.ops.indexer_topk.select import visible_entries, gather_candidates_kernel, select_final_kernel, select_kernel
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.transfer import to_device

TILE = 64          # entries per maximum (first selection stage), at most
MIN_TILE = 16
TILES_PER_TOPK = 4  # smaller tiles until a token has this many maxima per selected entry


def maxima_tile(n_max: int, topk: int) -> int:
    """Entries per tile maximum: TILE, halved (down to MIN_TILE) while the longest row has fewer
    than TILES_PER_TOPK·topk tiles. The k-th largest maximum bounds the selection from below; with
    few tiles per selected entry it is a loose bound (at 128K, 512 tiles for a top-512: the smallest
    maximum, and thousands of candidates for the exact stage)."""
    tile = TILE
    while tile > MIN_TILE and triton.cdiv(n_max, tile) < TILES_PER_TOPK * topk:
        tile //= 2
    return tile


@triton.jit
def _ordered(sc):
    """float32 -> uint32 whose unsigned order is the float order (−0 and +0 equal)."""
    u = (sc + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _bytes4(w):
    """int32 [A, B] -> its four bytes as int8 [A, B, 4], low byte first (joins keep them in one thread)."""
    b01 = tl.join(w.to(tl.int8), (w >> 8).to(tl.int8))                   # [A, B, 2]: bytes 0, 1
    b23 = tl.join((w >> 16).to(tl.int8), (w >> 24).to(tl.int8))          # bytes 2, 3
    return tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 3, 2)), [w.shape[0], w.shape[1], 4])


@triton.jit
def _float_keys(rows, POOL, s_row, D: tl.constexpr, OUT_T: tl.constexpr):
    """Float key rows [BN, D] as OUT_T (rows must be valid: no masks, so no per-element predicates)."""
    return tl.load(POOL + rows.to(tl.int64)[:, None] * s_row + tl.arange(0, D)[None, :]).to(OUT_T)


@triton.jit
def _fp4_load(blk, ent, POOL, s_row, D: tl.constexpr, WORDS: tl.constexpr, EPB: tl.constexpr):
    """The packed form of FP4 keys `ent` of pool blocks `blk` (a paged pool in the block layout of
    kv_formats.py: a block holds its EPB keys' codes first, then their scales), as loaded: (codes,
    scales) for `_fp4_decode16`. Split from the decoding so that a loop can issue the next tile's
    loads before it decodes this one. WORDS: the pool as int32 words with D = 128 (16 code words
    and one scale word per key; a key's codes are 64 aligned bytes, read with 16-byte loads):
    codes [BN, 16], scales [BN]; else bytes, s_row bytes per key: codes [BN, D/2] and each code
    byte's block scale [BN, D/2]."""
    blk = blk.to(tl.int64)
    if WORDS:
        NW: tl.constexpr = D // 8
        block = POOL + blk * (EPB * (NW + 1))       # a constexpr stride: the loads stay 16-byte vectors
        words = tl.load((block + ent * NW)[:, None] + tl.arange(0, NW)[None, :])                 # [BN, NW]
        # the scale word once per key (a load per word repeated it NW times: the kernel was bound by L1
        # load instructions, not by DRAM), broadcast along the row when decoding
        return words, tl.load(block + EPB * NW + ent)                                            # [BN]
    else:
        block = POOL + blk * (EPB * s_row)
        bi = tl.arange(0, D // 2)
        byte = tl.load((block + ent * (D // 2))[:, None] + bi[None, :]).to(tl.int32)
        e = tl.load((block + EPB * (D // 2) + ent * (D // 32))[:, None] + bi[None, :] // 16).to(tl.int32)  # [BN, D/2]
        return byte, e


@triton.jit
def _fp4_decode16(codes, scales, D: tl.constexpr, WORDS: tl.constexpr):
    """Packed FP4 keys (from `_fp4_load`) as fp16 [BN, D] scaled by 2^(127 − smax) (smax: the key's
    largest ue8m0 scale, returned [BN]): every value is exact (blocks more than 2²⁰ below the key's
    largest are dropped: they are below fp32 resolution of the score), and the MMA runs on fp16
    directly from the e4m3 widening, with no fp32 round trip. The factor 2^(smax−127) is applied to
    the score (ReLU commutes with positive scaling)."""
    BN: tl.constexpr = codes.shape[0]
    if WORDS:
        NW: tl.constexpr = D // 8
        words, sw_row = codes, scales                   # [BN, NW] code words, [BN] scale words
        wi = tl.arange(0, NW)
        smax = tl.maximum(tl.maximum(sw_row & 255, (sw_row >> 8) & 255),
                          tl.maximum((sw_row >> 16) & 255, (sw_row >> 24) & 255))               # [BN]
        sw = tl.broadcast_to(sw_row[:, None], (BN, NW))                                         # [BN, NW]
        # four codes per word at once: code (s e1 e0 m) -> e4m3 byte (s 0 0 e1 e0 m 0 0) = e2m1 · 2⁻⁶
        # (−0x7F7F7F80 is 0x80808080, the sign bit of every byte, as an int32)
        ev = ((words << 2) & 0x1C1C1C1C) | ((words << 4) & -0x7F7F7F80)                          # even elements
        od = ((words >> 2) & 0x1C1C1C1C) | (words & -0x7F7F7F80)                               # odd elements
        byte = tl.join(_bytes4(ev), _bytes4(od))                                                   # [BN, NW, 4, 2]
        val = tl.reshape(byte, [BN, NW, 8]).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        delta = ((sw >> ((wi // 4) * 8)[None, :]) & 255) - smax[:, None]                         # [BN, NW], ≤ 0
        f = ((delta + 21) << 10).to(tl.int16).to(tl.float16, bitcast=True)                      # 2^(delta+6)
        f = tl.where(delta >= -20, f, 0.0)
        k = tl.reshape(val * f[:, :, None], [BN, D])
    else:
        e = scales
        code = (codes[:, :, None] >> (tl.arange(0, 2) * 4)[None, None, :]) & 15                  # [BN, D/2, 2]
        b8 = (((code & 7) << 2) | ((code & 8) << 4)).to(tl.int8)
        val = b8.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        smax = tl.max(e, 1)
        delta = e - smax[:, None]
        f = tl.where(delta >= -20, ((delta + 21) << 10).to(tl.int16).to(tl.float16, bitcast=True), 0.0)
        k = tl.reshape(val * f[:, :, None], [BN, D])
    return k, smax


@triton.jit
def _fp4_keys16(blk, ent, POOL, s_row, D: tl.constexpr, WORDS: tl.constexpr, EPB: tl.constexpr):
    """FP4 keys `ent` of pool blocks `blk` as scaled fp16 and their largest scales: `_fp4_load`
    then `_fp4_decode16`."""
    codes, scales = _fp4_load(blk, ent, POOL, s_row, D, WORDS, EPB)
    return _fp4_decode16(codes, scales, D, WORDS)


@triton.jit
def _q16(q, w):
    """Rows of q as fp16 scaled into [1, 2) by a power of two 2^(127−e), and w · 2^(e−127) to undo it
    after the ReLU. Exact for bf16 (and FP4-grid) queries, but for elements 2²⁴ below a row's largest."""
    qf = q.to(tl.float32)
    e = (tl.max(tl.abs(qf), 1).to(tl.int32, bitcast=True) >> 23) & 255
    q16 = (qf * ((254 - e) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
    return q16, w * (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _block_entry(BT, s_bt, r, j, EPB: tl.constexpr):
    """(pool block, entry within it) of entries j of request r."""
    return tl.load(BT + r * s_bt + j // EPB), j % EPB


@triton.jit
def _rows(BT, s_bt, r, j, EPB: tl.constexpr, PAGED: tl.constexpr):
    """Pool rows of entries j (all valid entries of request r)."""
    if PAGED:
        blk = tl.load(BT + r * s_bt + j // EPB)
        return blk.to(tl.int64) * EPB + j % EPB
    else:
        return j.to(tl.int64)


@triton.jit
def score_decode_kernel(Q, sq_t, sq_h, W, sw_t, POOL, s_pool_row, BT, s_bt, TOK_REQ, VIS, KEYS, s_keys,
                        TMAX, s_tmax, H, D: tl.constexpr, BLOCK_H: tl.constexpr, BN: tl.constexpr,
                        CHUNK: tl.constexpr, TILE_N: tl.constexpr, FP4: tl.constexpr, WORDS: tl.constexpr,
                        PAGED: tl.constexpr, EPB: tl.constexpr, PREC: tl.constexpr, RATIO: tl.constexpr,
                        PDL: tl.constexpr):
    """One token × CHUNK keys: s[n] = Σ_h w_h relu(k_n · q_h) with the keys as MMA rows."""
    wait_then_release(PDL)
    t = tl.program_id(0)
    n_start = tl.program_id(1) * CHUNK
    vis = visible_entries(VIS, t, RATIO)
    if n_start < vis:
        r = tl.load(TOK_REQ + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        q = tl.load(Q + t.to(tl.int64) * sq_t + h[:, None] * sq_h + d[None, :], mask=(h < H)[:, None], other=0.0)
        w = tl.load(W + t.to(tl.int64) * sw_t + h, mask=h < H, other=0.0).to(tl.float32)
        if FP4:
            q, w = _q16(q, w)
        qt = tl.trans(q)                                                                         # [D, BLOCK_H]
        end = tl.minimum(n_start + CHUNK, vis)
        if FP4:
            # the loads of a tile are issued one iteration ahead (registers, not shared memory), so
            # that their latency overlaps the decoding and MMA of the tile before (indexer at 1M,
            # B=8: 203 -> 184 us on the H200, benchmarks/attention.py). The prefill tile kernel
            # loads in place: there the extra registers spill (255 registers and 8 B of stack, sm_90)
            blk, ent = _block_entry(BT, s_bt, r, tl.minimum(n_start + tl.arange(0, BN), end - 1), EPB)
            codes, scales = _fp4_load(blk, ent, POOL, s_pool_row, D, WORDS, EPB)
        for n0 in range(n_start, end, BN):
            j = n0 + tl.arange(0, BN)
            jv = j < end
            jc = tl.minimum(j, end - 1)                  # entries past the end: recomputed, not stored
            if FP4:
                k, smax = _fp4_decode16(codes, scales, D, WORDS)
                blk, ent = _block_entry(BT, s_bt, r, tl.minimum(j + BN, end - 1), EPB)
                codes, scales = _fp4_load(blk, ent, POOL, s_pool_row, D, WORDS, EPB)
            else:
                k = _float_keys(_rows(BT, s_bt, r, jc, EPB, PAGED), POOL, s_pool_row, D, q.dtype)
            s = tl.dot(k, qt, input_precision=PREC)                                             # [BN, BLOCK_H]
            sc = tl.sum(tl.maximum(s, 0.0) * w[None, :], 1)
            if FP4:
                sc = sc * (smax << 23).to(tl.float32, bitcast=True)
            key = tl.where(jv, _ordered(sc), 0)
            tl.store(KEYS + t.to(tl.int64) * s_keys + j, key.to(tl.int32, bitcast=True), mask=jv)
            tmax = tl.max(tl.reshape(key, [BN // TILE_N, TILE_N]), 1)
            ti = n0 // TILE_N + tl.arange(0, BN // TILE_N)
            tl.store(TMAX + t.to(tl.int64) * s_tmax + ti, tmax.to(tl.int32, bitcast=True), mask=ti * TILE_N < end)


@triton.jit
def score_tile_kernel(Q, sq_t, sq_h, W, sw_t, POOL, s_pool_row, BT, s_bt, TOK_REQ, VIS, TILE_T0, TILE_CNT,
                      KEYS, s_keys, TMAX, s_tmax, H, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                      BN: tl.constexpr, CHUNK: tl.constexpr, TILE_N: tl.constexpr, FP4: tl.constexpr,
                      WORDS: tl.constexpr, PAGED: tl.constexpr, EPB: tl.constexpr, PREC: tl.constexpr,
                      RATIO: tl.constexpr):
    """BLOCK_T consecutive tokens of one request × CHUNK keys (keys shared by the tile); BN a
    multiple of TILE_N."""
    tile = tl.program_id(0)
    n_start = tl.program_id(1) * CHUNK
    t0 = tl.load(TILE_T0 + tile)
    nt = tl.load(TILE_CNT + tile)
    ti = tl.arange(0, BLOCK_T)
    tmask = ti < nt
    vis_t = tl.load(VIS + t0 + ti, mask=tmask, other=0)
    if RATIO > 0:
        vis_t = tl.where(tmask, (vis_t + 1) // RATIO, 0)
    vis_max = tl.max(vis_t, 0)
    if n_start < vis_max:
        r = tl.load(TOK_REQ + t0).to(tl.int64)
        mrow = tl.arange(0, BLOCK_T * BLOCK_H)
        tok = t0 + mrow // BLOCK_H
        h = mrow % BLOCK_H
        rmask = (mrow // BLOCK_H < nt) & (h < H)
        d = tl.arange(0, D)
        q = tl.load(Q + tok.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h + d[None, :], mask=rmask[:, None],
                    other=0.0)
        w = tl.load(W + tok.to(tl.int64) * sw_t + h, mask=rmask, other=0.0).to(tl.float32)
        if FP4:
            q, w = _q16(q, w)
        end = tl.minimum(n_start + CHUNK, vis_max)
        for n0 in range(n_start, end, BN):
            j = n0 + tl.arange(0, BN)
            jv = j < end
            jc = tl.minimum(j, end - 1)
            if FP4:
                blk, ent = _block_entry(BT, s_bt, r, jc, EPB)
                k, smax = _fp4_keys16(blk, ent, POOL, s_pool_row, D, WORDS, EPB)
            else:
                k = _float_keys(_rows(BT, s_bt, r, jc, EPB, PAGED), POOL, s_pool_row, D, q.dtype)
            s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PREC), 0.0) * w[:, None]
            sc = tl.sum(tl.reshape(s, [BLOCK_T, BLOCK_H, BN]), 1)                              # [BLOCK_T, BN]
            if FP4:
                sc = sc * (smax << 23).to(tl.float32, bitcast=True)[None, :]
            valid = tmask[:, None] & (j[None, :] < vis_t[:, None])
            key = tl.where(valid, _ordered(sc), 0)
            tl.store(KEYS + (t0 + ti).to(tl.int64)[:, None] * s_keys + j[None, :], key.to(tl.int32, bitcast=True),
                     mask=tmask[:, None] & jv[None, :])
            tmax = tl.max(tl.reshape(key, [BLOCK_T, BN // TILE_N, TILE_N]), 2)                  # [BLOCK_T, BN/TILE_N]
            tix = n0 // TILE_N + tl.arange(0, BN // TILE_N)
            tl.store(TMAX + (t0 + ti).to(tl.int64)[:, None] * s_tmax + tix[None, :], tmax.to(tl.int32, bitcast=True),
                     mask=tmask[:, None] & (tix * TILE_N < end)[None, :])


# ----------------------------------------------------------------------------- launchers
SCORE_BUFFER = 1 << 28  # bytes of per-entry scratch (keys + candidates) held at once; tokens go in groups
# Scoring: keys per MMA tile, warps, pipeline stages. Selection: block over tile maxima, tiles per
# gather, block over candidates, radix levels (8 bits each) of the bound τ₀, warps.
DECODE_CFG = dict(BN=64, num_warps=4, num_stages=1)   # 1 stage: 277 against 389 µs at 1M, B=8 (H200 sweep)
PROGRAMS_PER_SM = 4     # decode scoring programs per SM to aim for (sets the chunk of keys per program)
# Prefill scoring tiles: ROWS query rows (tokens × heads) per program, BN keys per MMA tile, CHUNK keys
# per program; one stage and four warps (2,048 tokens at 128K: 7,849 µs, against 9,338 with eight warps
# and 10,919 with eight warps and two stages, a shape that also spills 8 B: H200 sweeps).
TILE_CFG = dict(ROWS=256, BN=64, CHUNK=2048, num_warps=4, num_stages=1)
SELECT_CFG = dict(BLOCK=4096, TB=64, CBLOCK=1024, TAU_LEVELS=2, num_warps=16)
# Launches of at most SPLIT_MAX_TOKENS tokens whose rows have at least SPLIT_MIN_TILES tile maxima
# gather their candidates in `select_groups(t)` programs per token (`gather_candidates_kernel`), then
# join them (`select_final_kernel`, CB per group at a time): 1M, B=1 69 against 97 µs (H200). The
# groups shrink as tokens grow (at most SELECT_GROUPS, at least 4, about SPLIT_PROGRAMS programs a
# launch), and beyond SPLIT_MAX_TOKENS one program a token selects: at 128K on an H100 (fp4 keys,
# top-512) B=8 44 µs with 4 or 8 groups against 50 with 16; B=64 179 µs one program a token against
# 274 with 16 groups. Prefill chunks keep one program per token: they fill the GPU already, and
# 2,048 tokens × 16 groups each computing τ₀ took 14.1 ms against 11.0 at 128K.
SPLIT_MIN_TILES = 1024
SPLIT_MAX_TOKENS = 16
SELECT_GROUPS = 16
SPLIT_PROGRAMS = 64
SPLIT_CFG = dict(gather=dict(BLOCK=4096, num_warps=8), final=dict(CB=128, num_warps=16))
# Launches whose rows hold at most this many entries select with every key in registers (no τ₀, no
# candidate copy; `select._select_resident`): a CSA layer's rows up to 16K context.
RESIDENT_SELECT_MAX = 4096


def select_groups(t: int) -> int:
    """Programs gathering each of t tokens' candidates in a split selection: a power of two (the
    joining kernel ranges over them), about `SPLIT_PROGRAMS` in all, from 4 to `SELECT_GROUPS`."""
    share = max(1, SPLIT_PROGRAMS // max(t, 1))
    return min(SELECT_GROUPS, max(4, 1 << (share.bit_length() - 1)))


def _tiles(req: np.ndarray, block_t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of ≤ block_t consecutive tokens of one request, from the tokens' requests on the host:
    (first token, count) on `device`, queued without waiting for the device."""
    t = req.shape[0]
    idx = np.arange(t)
    run_start = np.maximum.accumulate(np.where(np.r_[True, req[1:] != req[:-1]], idx, 0))
    t0 = np.flatnonzero((idx - run_start) % block_t == 0)     # every run starts a tile
    n = np.diff(np.r_[t0, t])
    return to_device(t0.astype(np.int32), device), to_device(n.astype(np.int32), device)


@functools.lru_cache(maxsize=8)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _chunk(tokens: int, n_max: int, bn: int, device: torch.device) -> int:
    """Keys per scoring program: enough programs to fill the GPU without tiny programs.
    The chunking never changes a score (each is one MMA row), only how the work is spread."""
    sms = _sms(device)
    want = max(1, tokens * n_max // (PROGRAMS_PER_SM * sms))
    return min(8192, max(4 * bn, triton.next_power_of_2(want)))


def _score_decode(q, weights, common, keys, tmax, n_max, per_max, head_dim, fp4, words, paged, epb, vis_ratio,
                  fp4_queries=False):
    """The decode scoring launch: one token's keys per program (chunks of them over the GPU), each
    score's order-preserving key into `keys` [T, n_max], each tile's largest into `tmax`. `common`:
    (pool, its row stride, block tables and their stride, token requests, visibility). FP4 keys with
    `fp4_queries` (queries on the FP4 grid) take the integer tensor-core kernel of `score_mma` where
    it runs."""
    t, h, _ = q.shape
    cfg = DECODE_CFG
    assert cfg["BN"] % TILE == 0, "decode scoring tiles must hold whole maxima tiles"
    chunk = _chunk(t, n_max, cfg["BN"], q.device)
    pool, _, tables, _, token_req, vis = common
    if fp4 and fp4_queries and score_mma.usable(q, weights, head_dim, words, epb, tables, token_req, vis):
        score_mma.score_decode(q, weights, pool, tables, token_req, vis, keys, tmax, n_max, chunk, per_max, epb,
                               vis_ratio)
        return
    score_decode_kernel[(t, triton.cdiv(n_max, chunk))](
        q, q.stride(0), q.stride(1), weights, weights.stride(0), *common, keys, keys.stride(0), tmax, tmax.stride(0),
        h, D=head_dim, BLOCK_H=max(16, triton.next_power_of_2(h)), BN=cfg["BN"], CHUNK=chunk, TILE_N=per_max,
        FP4=fp4, WORDS=words, PAGED=paged, EPB=epb, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        RATIO=vis_ratio, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **triton_args(q))


def _run(q, weights, pool, row_stride, block_tables, token_req, vis, topk, n_max, fp4, paged, epb, head_dim,
         block_t=None, words=False, vis_ratio=0, host_token_req=None, fp4_queries=False):
    """vis: [T] visible entries per token, or with vis_ratio > 0 the tokens' positions (the kernels
    compute (position + 1) // vis_ratio themselves). `host_token_req`: token_req on the host, from
    which the prefill tiles are made (without it the device is read once)."""
    t, h, _ = q.shape
    dev = q.device
    assert head_dim == triton.next_power_of_2(head_dim), "indexer head_dim must be a power of two"
    out = torch.empty((t, topk), dtype=torch.int32, device=dev)
    if t == 0:
        return out
    if n_max == 0:
        return out.fill_(-1)
    block_h = max(16, triton.next_power_of_2(h))
    if block_t is None:
        # decode-shaped scoring for few tokens, and always in deterministic mode (a token's scores must
        # not depend on the tile its batch happens to give it)
        block_t = 1 if t <= 64 or is_deterministic() else max(1, TILE_CFG["ROWS"] // block_h)
    per_max = maxima_tile(n_max, topk)
    n_tiles = triton.cdiv(n_max, per_max)
    split = n_tiles >= SPLIT_MIN_TILES and t <= SPLIT_MAX_TOKENS
    groups = select_groups(t)
    per_token = (20 if split else 12) * n_max + 8 * n_tiles + 4 * groups
    group = max(block_t, (SCORE_BUFFER // per_token) // block_t * block_t)
    # the candidate gather reads TB tiles at a time: the same number of entries whatever the tile
    select_cfg = dict(SELECT_CFG, TB=SELECT_CFG["TB"] * TILE // per_max)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    bt = block_tables if block_tables is not None else out
    if block_t > 1 and host_token_req is None:
        host_token_req = token_req.cpu().numpy()          # one read of the device for the whole launch
    for a in range(0, t, group):
        b = min(t, a + group)
        tn = b - a
        keys = torch.empty(tn, n_max, dtype=torch.int32, device=dev)
        tmax = torch.empty(tn, n_tiles, dtype=torch.int32, device=dev)
        tlist = torch.empty(tn, n_tiles, dtype=torch.int32, device=dev)
        cand = torch.empty(4 if split else 2, tn, n_max, dtype=torch.int32, device=dev)
        common = (pool, row_stride, bt, bt.stride(0), token_req[a:b], vis[a:b])
        if block_t == 1:
            _score_decode(q[a:b], weights[a:b], common, keys, tmax, n_max, per_max, head_dim, fp4, words, paged,
                          epb, vis_ratio, fp4_queries)
        else:
            tile_t0, tile_n = _tiles(host_token_req[a:b], block_t, dev)
            chunk = TILE_CFG["CHUNK"]
            assert TILE_CFG["BN"] % TILE == 0 and chunk % TILE_CFG["BN"] == 0, "prefill tiles hold whole maxima tiles"
            score_tile_kernel[(tile_t0.shape[0], triton.cdiv(n_max, chunk))](
                q[a:b], q.stride(0), q.stride(1), weights[a:b], weights.stride(0), *common, tile_t0, tile_n, keys,
                keys.stride(0), tmax, tmax.stride(0), h, D=head_dim, BLOCK_H=block_h, BLOCK_T=block_t,
                BN=TILE_CFG["BN"], CHUNK=chunk, TILE_N=per_max, FP4=fp4, WORDS=words, PAGED=paged, EPB=epb, PREC=prec,
                RATIO=vis_ratio, num_warps=TILE_CFG["num_warps"],
                num_stages=TILE_CFG["num_stages"])
        kpad = triton.next_power_of_2(topk)
        if split:
            cnt = torch.empty(tn, groups, dtype=torch.int32, device=dev)
            gcfg, fcfg = SPLIT_CFG["gather"], SPLIT_CFG["final"]
            gather_candidates_kernel[(tn, groups)](
                keys, keys.stride(0), tmax, tmax.stride(0), tlist, cand[0], cand[1], cand.stride(1), cnt, vis[a:b],
                topk, RATIO=vis_ratio, G=groups, TILE_N=per_max, BLOCK=gcfg["BLOCK"], TB=select_cfg["TB"],
                TAU_LEVELS=select_cfg["TAU_LEVELS"], num_warps=gcfg["num_warps"], **triton_args(keys))
            select_final_kernel[(tn,)](cand[0], cand[1], cand.stride(1), cand[2], cand[3], cnt, vis[a:b], out[a:b],
                                       out.stride(0), topk, RATIO=vis_ratio, G=groups, TILE_N=per_max,
                                       CB=fcfg["CB"],
                                       CBLOCK=select_cfg["CBLOCK"], KPAD=kpad, num_warps=fcfg["num_warps"],
                                       **triton_args(cand))
        else:
            vpad = triton.next_power_of_2(n_max) if n_max <= RESIDENT_SELECT_MAX else 0
            select_kernel[(tn,)](keys, keys.stride(0), tmax, tmax.stride(0), tlist, cand[0], cand[1],
                                 cand.stride(1), vis[a:b], out[a:b], out.stride(0), topk, RATIO=vis_ratio,
                                 TILE_N=per_max, KPAD=kpad, VPAD=vpad, **select_cfg, **triton_args(keys))
    return out


def indexer_topk(q, weights, keys, visible, topk):
    """Contiguous variant: q [T, H, d], weights [T, H], keys [N, d], visible [T] -> [T, min(topk, N)]."""
    t = q.shape[0]
    n = keys.shape[0]
    k = min(topk, n)
    z = torch.zeros(t, dtype=torch.int32, device=q.device)
    if k == 0:
        return torch.empty(t, 0, dtype=torch.int32, device=q.device)
    return _run(q, weights, keys, keys.stride(0), None, z, visible.to(torch.int32).clamp(max=n), k, n, False, False,
                1, keys.shape[1], host_token_req=np.zeros(t, dtype=np.int32))


def _paged_pool(q, batch: PagedBatch, pool, ratio, fmt, head_dim, max_visible):
    """The pool as the scoring kernels read it: (flat rows, FP4?, int32 words?, entries a block,
    the longest visible count)."""
    assert batch.positions.dtype == torch.int32
    if max_visible is None:     # a host sync: pass it under CUDA graphs
        max_visible = (int(batch.positions.max()) + 1) // ratio if batch.positions.numel() else 0
    fp4 = fmt == "fp4"              # packed keys come only in paged pools (their block layout)
    flat = pool.reshape(-1, pool.shape[-1])
    # blocks of 128-dim keys as int32 words (68 B per key); a key's codes are then 64 aligned bytes
    words = fp4 and (head_dim or q.shape[-1]) == 128 and flat.is_contiguous() and flat.data_ptr() % 16 == 0
    if words:
        flat = flat.view(torch.int32)
    return flat, fp4, words, batch.block_tokens // ratio, max_visible


def indexer_topk_paged(q, weights, batch: PagedBatch, pool, topk, ratio=4, fmt="bf16", head_dim=None, max_visible=None,
                       resident=None, fp4_queries=False, per_token=False):
    """See `hybridkv.ops.indexer_topk.indexer_topk_paged`. With `resident` the kernels score and
    select over the resident blocks alone (`_compact_resident`): a memory policy that keeps a tenth
    of a long context on the device pays for a tenth of the scoring and selection."""
    flat, fp4, words, epb, max_visible = _paged_pool(q, batch, pool, ratio, fmt, head_dim, max_visible)
    tables, vis, vis_ratio = batch.block_tables, batch.positions, ratio
    if resident is not None:
        tables, vis, logical = _compact_resident(batch, resident, ratio)
        vis_ratio = 0
    # one token per request (a decode group, known from the shapes) or asked per token: the decode-shaped scoring at any
    # batch size; the tile path groups a request's consecutive tokens, found on the host
    decode = per_token or batch.token_req.shape[0] == batch.block_tables.shape[0]
    idx = _run(q, weights, flat, flat.stride(0), tables, batch.token_req, vis, topk, max_visible, fp4, True, epb,
               head_dim or q.shape[-1], block_t=1 if decode else None, words=words, vis_ratio=vis_ratio,
               host_token_req=_host_requests(batch), fp4_queries=fp4_queries)
    if resident is None:
        return idx
    # back from the resident blocks' numbering to the request's own (order-preserving: still ascending)
    blocks = logical[batch.token_req.long().unsqueeze(1), idx.long().clamp(min=0) // epb]
    return torch.where(idx >= 0, blocks * epb + idx % epb, -1).to(torch.int32)


def _host_requests(batch: PagedBatch):
    """The batch's token requests as built on the host, where they still describe its tokens."""
    host = batch.host_token_req
    return host if host is not None and host.shape[0] == batch.token_req.shape[0] else None


def _compact_resident(batch: PagedBatch, resident: torch.Tensor, ratio: int):
    """The resident blocks of each request first, in their order: (their pool block ids [R, w] int32,
    each token's visible entries among them [T] int32, their block index in the request [R, w]
    int64), w = the block tables' width. On the device with fixed shapes (capturable); entries past a
    request's resident count are its last block's (never visible there)."""
    per = batch.block_tokens // ratio
    tables = batch.block_tables
    r, w = tables.shape
    res = resident[:, :w] >= 0
    before = torch.nn.functional.pad(res.cumsum(1, dtype=torch.int32), (1, 0))   # [R, w+1] resident blocks before b
    cols = torch.arange(w, device=tables.device).expand(r, w)
    slot = torch.where(res, before[:, 1:] - 1, w)                                 # where block b goes; w: dropped
    logical = torch.full((r, w + 1), w - 1, dtype=torch.int64, device=tables.device).scatter_(1, slot.long(), cols)
    logical = logical[:, :w]
    compact = tables.gather(1, logical).to(torch.int32)
    req = batch.token_req.long()
    vis = (batch.positions.long() + 1) // ratio
    full, part = vis // per, vis % per
    in_table = full < w
    fb = full.clamp(max=w - 1).unsqueeze(1)
    part_res = res[req.unsqueeze(1), fb].squeeze(1) & in_table
    cvis = before[req.unsqueeze(1), full.clamp(max=w).unsqueeze(1)].squeeze(1) * per + part_res * part
    return compact, cvis.to(torch.int32), logical


def paged_scores(q, weights, batch: PagedBatch, pool, ratio=4, fmt="bf16", head_dim=None, max_visible=None,
                 fp4_queries=False):
    """See `hybridkv.ops.indexer_topk.paged_scores`: the decode scoring launch of `indexer_topk_paged`
    alone (one token's keys per program, each score one MMA row), its order-preserving keys turned
    back into float32 scores."""
    flat, fp4, words, epb, n_max = _paged_pool(q, batch, pool, ratio, fmt, head_dim, max_visible)
    t = q.shape[0]
    dev = q.device
    keys = torch.zeros(t, n_max, dtype=torch.int32, device=dev)
    if t and n_max:
        bt = batch.block_tables
        common = (flat, flat.stride(0), bt, bt.stride(0), batch.token_req, batch.positions)
        tmax = torch.empty(t, triton.cdiv(n_max, TILE), dtype=torch.int32, device=dev)
        _score_decode(q, weights, common, keys, tmax, n_max, TILE, head_dim or q.shape[-1], fp4, words, True, epb,
                      ratio, fp4_queries)
    # the inverse of `_ordered`: keys with the top bit set held non-negative floats
    bits = torch.where(keys < 0, keys & 0x7FFFFFFF, ~keys)
    visible = (batch.positions.long() + 1) // ratio
    return bits.view(torch.float32).masked_fill(torch.arange(n_max, device=dev) >= visible.unsqueeze(1), float("-inf"))
