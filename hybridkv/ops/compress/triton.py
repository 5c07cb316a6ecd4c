"""Triton kernel for the compressor: one program per new entry pools its L token rows (per-channel
online softmax), applies RMSNorm and RoPE at the entry's first position, the storage round trip
(main: e4m3 nope dims in blocks of 64 with ue8m0 scales, or with plain amax/448 scales for float
stores of a checkpoint without scale_fmt ue8m0; indexer: Hadamard + E2M1 in blocks of 32) and writes
the entry straight into its paged pool row, packed (584-B / 68-B) or as float values.
A decode step's compressor runs as one launch (`compress_decode`): the state update, and where a
token ends a block its pooling, finishing and store; for V4.1's compressor (`compress_decode_latent`)
the finished entry is the normalised latent, returned for the layer to derive its indexer key and
global KV from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.hadamard.reference import hadamard_matrix
from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.triton import _bf16_round, _e2m1_round, _pow2_ceil_exp

MAIN_PACKED, MAIN_FLOAT, INDEX_PACKED, INDEX_FLOAT, LATENT = 0, 1, 2, 3, 4


@triton.jit
def _e4m3_round(v):
    """Round float32 values in [-448, 448] to the e4m3 grid, ties to even (done by hand: the Triton
    interpreter's own float32 -> fp8 conversion mis-rounds across binade boundaries)."""
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(v < 0, -r, r)


@triton.jit
def _rms_normed(x, NORM_W, eps, D: tl.constexpr, OUT_BF16: tl.constexpr):
    """A pooled entry x [D] (float32) RMS-normalised with weight NORM_W, in the output's precision
    before and after (rounded to nearest even here: a later bf16 conversion is exact)."""
    if OUT_BF16:
        x = _bf16_round(x)
    x = x * tl.rsqrt(tl.sum(x * x, 0) / D + eps) * tl.load(NORM_W + tl.arange(0, D))
    if OUT_BF16:
        x = _bf16_round(x)
    return x


@triton.jit
def _finish_store(x, e, j, req, NORM_W, COS, SIN, s_cs, HAD, OUT, s_out_row, BT, s_bt, eps, had_scale,
                  D: tl.constexpr, ROPE: tl.constexpr, MODE: tl.constexpr, OUT_BF16: tl.constexpr,
                  EPB: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr, BLOCK_LAYOUT: tl.constexpr,
                  POW2: tl.constexpr = True):
    """A pooled entry x [D] (float32): RMSNorm, RoPE with row e of COS/SIN, the storage round trip,
    written as entry j of request req (j −1: not written). POW2 False (MAIN_FLOAT only): the main
    entry's FP8 blocks take plain amax/448 scales, as a checkpoint without scale_fmt ue8m0 has them."""
    d = tl.arange(0, D)
    x = _rms_normed(x, NORM_W, eps, D, OUT_BF16)
    # RoPE on the last ROPE dims (adjacent pairs)
    pair = tl.arange(0, D // 2)
    ridx = pair - (D - ROPE) // 2
    rmask = ridx >= 0
    cos = tl.load(COS + e.to(tl.int64) * s_cs + ridx, mask=rmask, other=1.0)
    sin = tl.load(SIN + e.to(tl.int64) * s_cs + ridx, mask=rmask, other=0.0)
    a, b = tl.split(tl.reshape(x, [D // 2, 2]))
    x = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), [D])
    if OUT_BF16:
        x = _bf16_round(x)
    # destination row
    keep = j >= 0           # −1: computed but not stored (a fixed-shape batch where not every row completes)
    j = tl.maximum(j, 0)
    if PAGED:
        blk = tl.load(BT + req.to(tl.int64) * s_bt + j // EPB)
        row = blk.to(tl.int64) * EPB + j % EPB
    else:
        row = j.to(tl.int64)
    out = OUT + row * s_out_row
    if MODE <= 1:
        NOPE: tl.constexpr = D - ROPE
        xb = tl.reshape(x, [D // 64, 64])
        amax = tl.maximum(tl.max(tl.abs(xb), 1), 1e-4)
        if POW2:
            sexp = _pow2_ceil_exp(amax, 1.0 / 448.0)
            scale = (sexp << 23).to(tl.float32, bitcast=True)
            qv = _e4m3_round(tl.minimum(tl.maximum(xb / scale[:, None], -448.0), 448.0)).to(tl.float8e4nv)
            deq = tl.reshape(qv.to(tl.float32) * scale[:, None], [D])
        else:
            scale = tl.math.div_rn(amax, 448.0)
            qv = _e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(xb, scale[:, None]), -448.0), 448.0))
            deq = tl.reshape(qv * scale[:, None], [D])
            if OUT_BF16:      # more bits than bf16 holds (a power-of-two scale keeps e4m3's few)
                deq = _bf16_round(deq)
        if MODE == 0:
            tl.store(out + d, qv.to(tl.uint8, bitcast=True).reshape([D]), mask=(d < NOPE) & keep)
            rb = _bf16_round(x).to(tl.int32, bitcast=True) >> 16
            r = d - NOPE
            tl.store(out + NOPE + 2 * r, (rb & 255).to(tl.uint8), mask=(r >= 0) & keep)
            tl.store(out + NOPE + 2 * r + 1, ((rb >> 8) & 255).to(tl.uint8), mask=(r >= 0) & keep)
            blocks = tl.arange(0, D // 64)
            tl.store(out + NOPE + 2 * ROPE + blocks, sexp.to(tl.uint8), mask=(blocks < NOPE // 64) & keep)
        else:
            v = tl.where(d < NOPE, deq, x)
            if OUT.dtype.element_ty == tl.bfloat16:     # a float32 entry into a bf16 store: to nearest, by
                v = _bf16_round(v)                      # hand (the interpreter's conversion truncates)
            tl.store(out + d, v.to(OUT.dtype.element_ty), mask=keep)
    else:
        # Hadamard rotation (scaled by D^-1/2) as a product with the ±1 matrix, then E2M1 in blocks of 32
        xm = tl.reshape(x, [1, D]) + tl.zeros([16, D], tl.float32)
        hm = tl.load(HAD + d[:, None] * D + d[None, :])
        x = tl.max(tl.dot(xm, hm, input_precision=PREC), 0) * had_scale
        if OUT_BF16:
            x = _bf16_round(x)
        xb = tl.reshape(x, [D // 32, 32])
        amax = tl.maximum(tl.max(tl.abs(xb), 1), 6.0 * 1.1754943508222875e-38)
        sexp = _pow2_ceil_exp(amax, 1.0 / 6.0)
        scale = (sexp << 23).to(tl.float32, bitcast=True)
        qv = _e2m1_round(tl.minimum(tl.maximum(xb / scale[:, None], -6.0), 6.0))
        if MODE == 3:
            tl.store(out + d, tl.reshape(qv * scale[:, None], [D]).to(OUT.dtype.element_ty), mask=keep)
        else:
            mag = tl.abs(qv)
            code = tl.where(mag < 2, mag * 2, tl.where(mag < 4, mag + 2, mag * 0.5 + 4)).to(tl.int32)
            code = tl.where((qv < 0) & (mag > 0), code | 8, code)
            lo, hi = tl.split(tl.reshape(code, [D // 2, 2]))
            if BLOCK_LAYOUT:     # the pool's blocks keep their EPB entries' codes first, then their scales
                block = OUT + (row // EPB) * (EPB * s_out_row)
                codes_at = block + (row % EPB) * (D // 2)
                scales_at = block + EPB * (D // 2) + (row % EPB) * (D // 32)
            else:
                codes_at = out
                scales_at = out + D // 2
            tl.store(codes_at + pair, (lo | (hi << 4)).to(tl.uint8), mask=keep)
            blocks = tl.arange(0, D // 32)
            tl.store(scales_at + blocks, sexp.to(tl.uint8), mask=keep)


@triton.jit
def _pool_rows(m, den, acc, sc, kv):
    """One chunk of rows (score sc, kv [ROWS, D]) into the per-channel online softmax (m, den, acc)."""
    m_new = tl.maximum(m, tl.max(sc, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe[None, :])
    alpha = tl.exp(m - m_safe)
    return m_new, den * alpha + tl.sum(p, 0), acc * alpha + tl.sum(p * kv, 0)


@triton.jit
def compress_kernel(KV, SCORE, s_row_n, s_row_l, NORM_W, COS, SIN, s_cs, HAD, OUT, s_out_row, BT, s_bt, ENT_REQ, ENT_J,
                    eps, had_scale, L: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
                    MODE: tl.constexpr,
                    OUT_BF16: tl.constexpr, EPB: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
                    BLOCK_LAYOUT: tl.constexpr = False, POW2: tl.constexpr = True):
    e = tl.program_id(0)
    d = tl.arange(0, D)
    # per-channel online softmax over the L rows
    m = tl.full([D], float("-inf"), tl.float32)
    den = tl.zeros([D], tl.float32)
    acc = tl.zeros([D], tl.float32)
    base = e.to(tl.int64) * s_row_n
    for l0 in range(0, L, ROWS):
        rows = l0 + tl.arange(0, ROWS)
        off = base + rows[:, None] * s_row_l + d[None, :]
        sc = tl.load(SCORE + off)
        kv = tl.load(KV + off)
        m, den, acc = _pool_rows(m, den, acc, sc, kv)
    x = acc / den
    j = tl.load(ENT_J + e)
    req = tl.load(ENT_REQ + e)
    _finish_store(x, e, j, req, NORM_W, COS, SIN, s_cs, HAD, OUT, s_out_row, BT, s_bt, eps, had_scale,
                  D, ROPE, MODE, OUT_BF16, EPB, PAGED, PREC, BLOCK_LAYOUT, POW2)


def pool_chunk(rows: int) -> int:
    """Rows a kernel handles at once out of `rows` (a block's pooled rows, or a ratio's): the largest
    power of two that divides them, at most 8 (`tl.arange` needs a power of two; any ratio works)."""
    return min(8, rows & -rows)


def compress_write(kv_rows: torch.Tensor, score_rows: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                   cos: torch.Tensor, sin: torch.Tensor, kind: str, out: torch.Tensor, packed: bool,
                   ent_j: torch.Tensor, ent_req: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
                   entries_per_block: int = 1, out_bf16: bool = False, block_layout: bool = False,
                   pow2: bool = True) -> None:
    """Pool, finish and write n entries. kv_rows/score_rows [n, L, d] float32; cos/sin [n, rope/2];
    out: pool rows [num_rows, E] (flat) written at row block_tables[req, j // epb]·epb + j % epb (or j).
    block_layout: packed indexer keys go to the block layout of kv_formats.py (codes first in each block
    of entries_per_block rows). pow2 False: plain FP8 scales of float main entries (not packed)."""
    _check_scales(kind, packed, pow2)
    n, L, d = kv_rows.shape
    if n == 0:
        return
    kv_rows, score_rows = kv_rows.float().contiguous(), score_rows.float().contiguous()
    rows = pool_chunk(L)
    mode = _mode(kind, packed)
    had = hadamard_matrix(d, kv_rows.device) if kind == "index" else kv_rows
    paged = block_tables is not None
    bt = block_tables if paged else ent_j
    req = ent_req if ent_req is not None else ent_j
    compress_kernel[(n,)](kv_rows, score_rows, kv_rows.stride(0), kv_rows.stride(1), norm_weight.float().contiguous(),
                          cos.float().contiguous(), sin.float().contiguous(), cos.shape[1] if cos.dim() > 1 else 0,
                          had, out, out.stride(0), bt, bt.stride(0) if paged else 0, req, ent_j.to(torch.int32),
                          eps, d ** -0.5, L=L, D=d, ROPE=2 * cos.shape[-1], ROWS=rows, MODE=mode, OUT_BF16=out_bf16,
                          EPB=entries_per_block, PAGED=paged, PREC="ieee", BLOCK_LAYOUT=block_layout and mode == INDEX_PACKED,
                          POW2=pow2, num_warps=4)


def _mode(kind: str, packed: bool) -> int:
    """The kernels' MODE for entries of this kind ("main", "index"), packed or as float values."""
    return {("main", True): MAIN_PACKED, ("main", False): MAIN_FLOAT, ("index", True): INDEX_PACKED,
            ("index", False): INDEX_FLOAT}[(kind, packed)]


def _check_scales(kind: str, packed: bool, pow2: bool) -> None:
    """Plain FP8 scales (pow2 False) apply to main entries, stored as floats: a packed main entry holds
    ue8m0 scale bytes. (Indexer keys take power-of-two FP4 scales whatever pow2 says.)"""
    if not pow2 and packed and kind == "main":
        raise ValueError("packed main entries store ue8m0 scales: plain FP8 scales need a float store")


@triton.jit
def compress_decode_kernel(ST_KV, ST_SCORE, s_st_slot, s_st_row, NEW_KV, NEW_SCORE, s_new, APE, SLOTS, POS, NORM_W,
                           COS, SIN, s_cs, HAD, OUT, s_out_row, BT, s_bt, IDS, SAVE_KV, SAVE_SCORE, s_save, eps,
                           had_scale, n_req, s_save_wave, R: tl.constexpr,
                           OVERLAP: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr, ROWS: tl.constexpr,
                           ADV: tl.constexpr, MODE: tl.constexpr, OUT_BF16: tl.constexpr, EPB: tl.constexpr, PREC: tl.constexpr,
                           BLOCK_LAYOUT: tl.constexpr, HAS_APE: tl.constexpr, SAVE: tl.constexpr, PDL: tl.constexpr,
                           POW2: tl.constexpr = True, WAVES: tl.constexpr = 1, SAVE_FROM: tl.constexpr = 0):
    """Program b: request b's decode tokens, WAVES of them one after another (row w·n_req + b of
    POS, NEW_KV, NEW_SCORE, COS and SIN: a speculative step's verify waves, each token at the
    position after the one before). Each token's compressor rows go into the request's state (row
    CUR + pos % R of its slot); when the token ends a block, the block is pooled from the state (in
    the row order and chunks of `compress_kernel`, so the entry is the same to the bit), finished,
    written as entry (pos + 1) / R − 1, and the state advances (overlap: the block becomes the
    previous one; its rows are cleared). With HAS_APE the token's score row gets the position bias
    APE[pos % R] added here (the float32 addition `Compressor.project` makes). MODE LATENT (V4.1):
    the finished entry is the pooled block's RMSNorm alone, written to row b of OUT, and its id to
    IDS[b]; a token that ends no block writes zeros and −1. With SAVE, before the tokens of waves
    w ≥ SAVE_FROM, the slot's state as it was is copied to SAVE_KV / SAVE_SCORE at (w − SAVE_FROM)·
    s_save_wave + b·s_save, [L, WIDTH] (a speculative verify wave's copy, which the rollback
    restores)."""
    wait_then_release(PDL)
    b = tl.program_id(0)
    slot = tl.load(SLOTS + b).to(tl.int64)
    CUR: tl.constexpr = R if OVERLAP else 0
    WIDTH: tl.constexpr = 2 * D if OVERLAP else D
    L: tl.constexpr = 2 * R if OVERLAP else R
    base = slot * s_st_slot
    c = tl.arange(0, WIDTH)
    for w in tl.static_range(WAVES):
        i = b + w * n_req                   # this wave's row of the request
        pos = tl.load(POS + i).to(tl.int64)
        new = i.to(tl.int64) * s_new
        ape = APE + (pos % R) * WIDTH
        if SAVE and w >= SAVE_FROM:
            for l0 in range(0, L, ROWS):
                rows = l0 + tl.arange(0, ROWS)
                src = base + rows[:, None] * s_st_row + c[None, :]
                dst = (w - SAVE_FROM) * s_save_wave + b.to(tl.int64) * s_save + rows[:, None] * WIDTH + c[None, :]
                tl.store(SAVE_KV + dst, tl.load(ST_KV + src))
                tl.store(SAVE_SCORE + dst, tl.load(ST_SCORE + src))
        if pos % R == R - 1:
            d = tl.arange(0, D)
            m = tl.full([D], float("-inf"), tl.float32)
            den = tl.zeros([D], tl.float32)
            acc = tl.zeros([D], tl.float32)
            for l0 in range(0, L, ROWS):
                rows = l0 + tl.arange(0, ROWS)
                # overlap: the previous block's rows through channels [0, D), this block's through [D, 2D)
                ch = d[None, :] + (rows[:, None] >= R).to(tl.int32) * D
                is_new = rows[:, None] == L - 1      # the token's own row, not in the state yet
                new_sc = tl.load(NEW_SCORE + new + ch, mask=is_new, other=0.0)
                if HAS_APE:
                    new_sc = new_sc + tl.load(ape + ch, mask=is_new, other=0.0)
                sc = tl.where(is_new, new_sc, tl.load(ST_SCORE + base + rows[:, None] * s_st_row + ch))
                kv = tl.where(is_new, tl.load(NEW_KV + new + ch, mask=is_new, other=0.0),
                              tl.load(ST_KV + base + rows[:, None] * s_st_row + ch))
                m, den, acc = _pool_rows(m, den, acc, sc, kv)
            if MODE == 4:       # LATENT
                x = _rms_normed(acc / den, NORM_W, eps, D, OUT_BF16)
                tl.store(OUT + i.to(tl.int64) * s_out_row + d, x.to(OUT.dtype.element_ty))
                tl.store(IDS + i, (pos + 1) // R - 1)
            else:
                _finish_store(acc / den, i, (pos + 1) // R - 1, b, NORM_W, COS, SIN, s_cs, HAD, OUT, s_out_row, BT,
                              s_bt, eps, had_scale, D, ROPE, MODE, OUT_BF16, EPB, True, PREC, BLOCK_LAYOUT, POW2)
            for r0 in range(0, R, ADV):
                rows = r0 + tl.arange(0, ADV)
                at = base + (CUR + rows[:, None]) * s_st_row + c[None, :]
                if OVERLAP:   # this block (with the token's row) becomes the previous block
                    is_new = rows[:, None] == R - 1
                    kv = tl.where(is_new, tl.load(NEW_KV + new + c[None, :] + rows[:, None] * 0, mask=is_new,
                                                  other=0.0),
                                  tl.load(ST_KV + at))
                    new_sc = tl.load(NEW_SCORE + new + c[None, :] + rows[:, None] * 0, mask=is_new, other=0.0)
                    if HAS_APE:
                        new_sc = new_sc + tl.load(ape + c[None, :] + rows[:, None] * 0, mask=is_new, other=0.0)
                    sc = tl.where(is_new, new_sc, tl.load(ST_SCORE + at))
                    tl.store(ST_KV + base + rows[:, None] * s_st_row + c[None, :], kv)
                    tl.store(ST_SCORE + base + rows[:, None] * s_st_row + c[None, :], sc)
                tl.store(ST_KV + at, tl.zeros([ADV, WIDTH], tl.float32))
                tl.store(ST_SCORE + at, tl.full([ADV, WIDTH], float("-inf"), tl.float32))
        else:
            if MODE == 4:       # LATENT
                d = tl.arange(0, D)
                tl.store(OUT + i.to(tl.int64) * s_out_row + d, tl.zeros([D], tl.float32).to(OUT.dtype.element_ty))
                tl.store(IDS + i, tl.full([], -1, tl.int64))
            row = base + (CUR + pos % R) * s_st_row
            tl.store(ST_KV + row + c, tl.load(NEW_KV + new + c))
            new_sc = tl.load(NEW_SCORE + new + c)
            if HAS_APE:
                new_sc = new_sc + tl.load(ape + c)
            tl.store(ST_SCORE + row + c, new_sc)
        if WAVES > 1:
            tl.debug_barrier()      # the next wave reads the state this one wrote, in other threads


def _decode_inputs(state_kv: torch.Tensor, state_score: torch.Tensor, kv: torch.Tensor,
                   score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode launch's token rows as the kernel reads them (float32; they may be column slices of
    one stacked projection: rows of one stride, columns contiguous), its state checked."""
    kv, score = kv.float(), score.float()
    if kv.stride(-1) != 1 or score.stride(-1) != 1 or kv.stride(0) != score.stride(0):
        kv, score = kv.contiguous(), score.contiguous()
    if not (state_kv.is_contiguous() and state_score.is_contiguous() and state_kv.dtype == torch.float32):
        raise ValueError("compress_decode: the compressor state must be contiguous float32")
    return kv, score


def compress_decode(state_kv: torch.Tensor, state_score: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                    kv: torch.Tensor, score: torch.Tensor, ratio: int, overlap: bool, norm_weight: torch.Tensor,
                    eps: float, cos: torch.Tensor, sin: torch.Tensor, kind: str, out: torch.Tensor,
                    block_tables: torch.Tensor, entries_per_block: int, out_bf16: bool = False,
                    block_layout: bool = False, ape: torch.Tensor | None = None,
                    save: tuple[torch.Tensor, torch.Tensor] | None = None, packed: bool = True,
                    pow2: bool = True, waves: int = 1) -> None:
    """One decode token per request and wave, one launch: state_kv/state_score [slots, rows, width]
    float32 (updated in place), slots [B], positions [waves·B] (wave after wave: request b's token of
    wave w at row w·B + b, one position after its token of wave w − 1), the tokens' compressor rows
    kv/score [waves·B, width]; cos/sin [waves·B, rope/2] the rotation at each token's block start
    (used where the token ends a block); entries go packed into `out` (pool rows [num_rows, E],
    flat) at block_tables' rows. `ape` [ratio, width]: the position bias still to be added to the
    score rows (None: already added). `save`: (kv, score) that receive each request's state before
    the update: [B, rows, width] float32 for one wave; for several, [waves − 1, B, rows, width] (the
    states before waves 1.., each wave's [B, rows, width] contiguous). `packed` False: `out` holds
    float entries (a bf16 or native store), main ones with plain FP8 scales where `pow2` is False."""
    _check_scales(kind, packed, pow2)
    b = slots.shape[0]
    if b == 0:
        return
    if kv.shape[0] != waves * b or positions.shape[0] != waves * b:
        raise ValueError(f"compress_decode: {kv.shape[0]} rows and {positions.shape[0]} positions for {waves} "
                         f"waves of {b} requests")
    d = state_kv.shape[-1] // (2 if overlap else 1)
    kv, score = _decode_inputs(state_kv, state_score, kv, score)
    state_rows = (b,) + state_kv.shape[1:]
    want = state_rows if waves == 1 else (waves - 1,) + state_rows
    if save is not None and not all(t.shape == want and t.dtype == torch.float32 and t[(0,) * (len(want) - 3)]
                                    .is_contiguous() and t.stride() == save[0].stride() for t in save):
        raise ValueError(f"compress_decode: the state copies must be float32 {list(want)}, each request's "
                         f"[{state_kv.shape[1]}, {state_kv.shape[2]}] contiguous")
    save_kv, save_score = save if save is not None else (state_kv, state_score)
    s_save = save_kv.stride(-3) if save is not None else 0
    s_save_wave = save_kv.stride(0) if save is not None and waves > 1 else 0
    mode = _mode(kind, packed)
    had = hadamard_matrix(d, kv.device) if kind == "index" else kv
    pooled = 2 * ratio if overlap else ratio
    rows = pool_chunk(pooled)      # compress_kernel's chunks of the pooled rows
    compress_decode_kernel[(b,)](
        state_kv, state_score, state_kv.stride(0), state_kv.stride(1), kv, score, kv.stride(0),
        kv if ape is None else ape.float().contiguous(), slots, positions,
        norm_weight.float().contiguous(), cos.float().contiguous(), sin.float().contiguous(), cos.shape[1], had,
        out, out.stride(0), block_tables, block_tables.stride(0), slots, save_kv, save_score, s_save, eps,
        d ** -0.5, b, s_save_wave, R=ratio, OVERLAP=overlap, D=d,
        ROPE=2 * cos.shape[-1], ROWS=rows, ADV=pool_chunk(ratio), MODE=mode, OUT_BF16=out_bf16, EPB=entries_per_block, PREC="ieee",
        BLOCK_LAYOUT=block_layout and mode == INDEX_PACKED, HAS_APE=ape is not None, SAVE=save is not None,
        POW2=pow2, WAVES=waves, SAVE_FROM=1 if waves > 1 else 0, num_warps=4, **triton_args(state_kv))


def compress_decode_latent(state_kv: torch.Tensor, state_score: torch.Tensor, slots: torch.Tensor,
                           positions: torch.Tensor, kv: torch.Tensor, score: torch.Tensor, ratio: int,
                           norm_weight: torch.Tensor, eps: float,
                           out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """V4.1's compressor (no overlap, no position bias) for one decode token per request, one
    launch: the state as `compress_decode`; returns (latent [B, d] of out_dtype: the RMSNorm of each
    block a token ends, zeros where it ends none; entry ids [B] int64, −1 where none)."""
    b, d = kv.shape
    out = torch.empty(b, d, dtype=out_dtype, device=kv.device)
    ids = torch.empty(b, dtype=torch.int64, device=kv.device)
    if b == 0:
        return out, ids
    kv, score = _decode_inputs(state_kv, state_score, kv, score)
    compress_decode_kernel[(b,)](
        state_kv, state_score, state_kv.stride(0), state_kv.stride(1), kv, score, kv.stride(0), kv, slots, positions,
        norm_weight.float().contiguous(), kv, kv, 0, kv, out, out.stride(0), slots, 0, ids, state_kv, state_score, 0,
        eps, 1.0, b, 0, R=ratio,
        OVERLAP=False, D=d, ROPE=0, ROWS=pool_chunk(ratio), ADV=pool_chunk(ratio),
        MODE=LATENT, OUT_BF16=out_dtype == torch.bfloat16, EPB=1, PREC="ieee", BLOCK_LAYOUT=False, HAS_APE=False,
        SAVE=False, num_warps=4, **triton_args(state_kv))
    return out, ids
