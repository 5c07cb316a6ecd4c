"""Triton kernels for sparse attention with a sink: one query token × a block of heads × a piece of
its row list per program. The row list of a token is its window rows, then its compressed rows.

Rows come from three places, chosen per row: the chunk's own new rows (positions ≥ the chunk
start), the request's window ring (earlier positions, ring row pos % window) and the compressed
pool (CSA: the entries of the token's index list; HCA: every entry j < (pos+1)//ratio). Packed fp8
entries (584 B) are read as int32 words and dequantised once per tile of BLOCK_N rows: e4m3 nope
bytes × their ue8m0 tile scale, bf16 rope, into the MMA dtype.

Decode splits the row list into fixed pieces of `split` rows (flash-decoding) over many programs;
`combine_kernel` merges a token's pieces in a fixed order together with the sink, split over
heads and head dims. Prefill takes one piece per token (all heads of a block at once, the output
written directly). Deterministic mode fixes every shape that touches a token's arithmetic (head
block, row tile, piece size, warps), so a token's result does not depend on its batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.qgemm.triton import _e2m1

LOG2E = 1.4426950408889634


@triton.jit
def _load_rows(ptr, valid, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, OUT_T: tl.constexpr,
               BLOCK_D: tl.constexpr = None, POOL_ROWS: tl.constexpr = False):
    """Rows [BN, BLOCK_D] as OUT_T from row base pointers `ptr` [BN]: FMT 1, int32 words of V4's packed
    fp8 entries (BLOCK_D = D); FMT 2, int8 bytes of V4.1's packed rows (BLOCK_D = D): window rows, or
    global KV entries where POOL_ROWS; FMT 0, elements (dims ≥ D zero)."""
    BN: tl.constexpr = ptr.shape[0]
    if FMT == 2:
        if POOL_ROWS:
            # [E2M1 pairs, low nibble the even element: D/2][e4m3 scale per 16: D/16]
            codes = tl.load(ptr[:, None] + tl.arange(0, D // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
            vals = tl.reshape(tl.join(_e2m1(codes & 15), _e2m1((codes >> 4) & 15)), [BN, D])
            sc = tl.load(ptr[:, None] + D // 2 + (tl.arange(0, D) // 16)[None, :], mask=valid[:, None], other=0)
            scale = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            # [e4m3: D][ue8m0 scale per 32: D/32]
            byte = tl.load(ptr[:, None] + tl.arange(0, D)[None, :], mask=valid[:, None], other=0)
            vals = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            sc = tl.load(ptr[:, None] + D + (tl.arange(0, D) // 32)[None, :], mask=valid[:, None], other=0)
            scale = ((sc.to(tl.int32) & 255) << 23).to(tl.float32, bitcast=True)
        # exact in bf16 too: an e2m1 or e4m3 value times an e4m3 or power-of-two scale
        return (vals * scale).to(OUT_T)
    elif FMT == 1:
        NOPE: tl.constexpr = D - ROPE
        NB: tl.constexpr = D // 64                    # 64-wide dim blocks: NOPE // 64 nope blocks, then rope
        blk = tl.arange(0, NB)
        is_nope = blk < NOPE // 64
        wi = tl.arange(0, 16)
        m3 = valid[:, None, None] & is_nope[None, :, None]
        words = tl.load(ptr[:, None, None] + (blk[None, :, None] * 16 + wi[None, None, :]), mask=m3, other=0)
        # the four bytes of a word as a new minor dim, kept in one thread (joins, not a broadcast shift)
        b01 = tl.join(words.to(tl.int8), (words >> 8).to(tl.int8))
        b23 = tl.join((words >> 16).to(tl.int8), (words >> 24).to(tl.int8))
        byte = tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 2, 4, 3)), [BN, NB, 16, 4])
        sw = tl.load(ptr[:, None] + (NOPE + 2 * ROPE) // 4 + blk[None, :] // 4,
                     mask=valid[:, None] & is_nope[None, :], other=0)
        # 2^(e−127) in OUT_T (exact: a power of two); the products below are exact in bf16 too
        scale = (((sw >> ((blk % 4) * 8)[None, :]) & 255) << 23).to(tl.float32, bitcast=True).to(OUT_T)
        nope = byte.to(tl.float8e4nv, bitcast=True).to(OUT_T) * scale[:, :, None, None]
        rw = tl.load(ptr[:, None] + NOPE // 4 + tl.arange(0, ROPE // 2)[None, :], mask=valid[:, None], other=0)
        lo = (rw & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
        hi = (rw >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        rope = tl.reshape(tl.join(lo, hi), [BN, ROPE]).to(OUT_T)                                   # ROPE == 64
        kv = tl.where(is_nope[None, :, None], tl.reshape(nope, [BN, NB, 64]), rope[:, None, :])
        return tl.reshape(kv, [BN, D])
    elif BLOCK_D == D:
        d = tl.arange(0, D)
        return tl.load(ptr[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(OUT_T)
    else:
        d = tl.arange(0, BLOCK_D)
        return tl.load(ptr[:, None] + d[None, :], mask=valid[:, None] & (d < D)[None, :], other=0.0).to(OUT_T)


@triton.jit
def _update(q, kv, valid, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """One row tile of the online softmax: (running max, sum, unnormalised output) after kv."""
    s = tl.dot(q, tl.trans(kv), input_precision=PREC) * scale_log2
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(kv.dtype), kv, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def sparse_attn_kernel(
    Q, sq_t, sq_h, O, so_t, so_s, so_h, ML, sml_t, sml_s,
    NEW, s_new, RING, s_ring_slot, s_ring_row, POOL, s_pool_row, BT, s_bt, IDX, s_idx,
    TOK_REQ, POS, SLOTS, SEG_START, SEG_ROW0, SINK, scale_log2, H, K_IDX, split_rows,
    D: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FMT: tl.constexpr, WINDOW: tl.constexpr, MODE: tl.constexpr, RATIO: tl.constexpr, EPB: tl.constexpr,
    PAGED: tl.constexpr, FINAL: tl.constexpr, PREC: tl.constexpr, TWO_LOOPS: tl.constexpr, PDL: tl.constexpr,
):
    wait_then_release(PDL)
    t = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    r = tl.load(TOK_REQ + t)
    pos = tl.load(POS + t)
    if MODE == 1:
        n_comp = K_IDX
    elif MODE == 2:
        n_comp = (pos + 1) // RATIO
    else:
        n_comp = 0
    total = WINDOW + n_comp
    start = sp * split_rows
    if start < total:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        q = tl.load(Q + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        end = tl.minimum(start + split_rows, total)
        if TWO_LOOPS:
            if WINDOW > 0:
                # window rows: positions pos−WINDOW+1 .. pos, from the chunk's new rows or the ring
                seg_start = tl.load(SEG_START + r)
                seg_row0 = tl.load(SEG_ROW0 + r)
                slot = tl.load(SLOTS + r).to(tl.int64)
                for n0 in range(start, tl.minimum(end, WINDOW), BLOCK_N):
                    v = n0 + tl.arange(0, BLOCK_N)
                    p = pos - (WINDOW - 1) + v
                    new_ptr = NEW + (seg_row0 + tl.maximum(p - seg_start, 0)).to(tl.int64) * s_new
                    ring_ptr = RING + slot * s_ring_slot + (tl.maximum(p, 0) % WINDOW).to(tl.int64) * s_ring_row
                    valid = (p >= 0) & (v < end) & (v < WINDOW)
                    kv = _load_rows(tl.where(p >= seg_start, new_ptr, ring_ptr), valid, D, ROPE, FMT, q.dtype, BLOCK_D)
                    m_i, l_i, acc = _update(q, kv, valid, m_i, l_i, acc, scale_log2, PREC)
            if MODE > 0:
                # compressed rows: CSA the token's index list, HCA every visible entry
                for n0 in range(tl.maximum(start, WINDOW), end, BLOCK_N):
                    c = n0 - WINDOW + tl.arange(0, BLOCK_N)
                    if MODE == 1:
                        j = tl.load(IDX + t.to(tl.int64) * s_idx + c, mask=c < n_comp, other=-1)
                    else:
                        j = c
                    valid = (j >= 0) & (c < end - WINDOW)
                    jc = tl.where(valid, j, 0)
                    if PAGED:
                        blk = tl.load(BT + r.to(tl.int64) * s_bt + jc // EPB, mask=valid, other=0)
                        row = blk.to(tl.int64) * EPB + jc % EPB
                    else:
                        row = jc.to(tl.int64)
                    kv = _load_rows(POOL + row * s_pool_row, valid, D, ROPE, FMT, q.dtype, BLOCK_D, True)
                    m_i, l_i, acc = _update(q, kv, valid, m_i, l_i, acc, scale_log2, PREC)
        else:
            # one loop over the whole row list (fewer registers live: packed fp8 with 64-head blocks)
            if WINDOW > 0:
                seg_start = tl.load(SEG_START + r)
                seg_row0 = tl.load(SEG_ROW0 + r)
                slot = tl.load(SLOTS + r).to(tl.int64)
            for n0 in range(start, end, BLOCK_N):
                v = n0 + tl.arange(0, BLOCK_N)
                c = v - WINDOW
                if MODE == 1:
                    j = tl.load(IDX + t.to(tl.int64) * s_idx + c, mask=(c >= 0) & (c < n_comp), other=-1)
                else:
                    j = tl.where((c >= 0) & (c < n_comp), c, -1)
                valid = j >= 0
                jc = tl.where(valid, j, 0)
                if PAGED:
                    blk = tl.load(BT + r.to(tl.int64) * s_bt + jc // EPB, mask=valid, other=0)
                    row = blk.to(tl.int64) * EPB + jc % EPB
                else:
                    row = jc.to(tl.int64)
                ptr = POOL + row * s_pool_row
                if WINDOW > 0:
                    p = pos - (WINDOW - 1) + v
                    in_win = v < WINDOW
                    new_ptr = NEW + (seg_row0 + tl.maximum(p - seg_start, 0)).to(tl.int64) * s_new
                    ring_ptr = RING + slot * s_ring_slot + (tl.maximum(p, 0) % WINDOW).to(tl.int64) * s_ring_row
                    ptr = tl.where(in_win, tl.where(p >= seg_start, new_ptr, ring_ptr), ptr)
                    valid = tl.where(in_win, p >= 0, valid)
                valid = valid & (v < end)
                kv = _load_rows(ptr, valid, D, ROPE, FMT, q.dtype, BLOCK_D)   # FMT 0 or 1: one row format
                m_i, l_i, acc = _update(q, kv, valid, m_i, l_i, acc, scale_log2, PREC)
        omask = hmask[:, None] & dmask[None, :]
        if FINAL:
            sink = tl.load(SINK + heads, mask=hmask, other=0.0) * 1.4426950408889634
            m_all = tl.maximum(m_i, sink)
            denom = l_i * tl.exp2(m_i - m_all) + tl.exp2(sink - m_all)
            out = acc * (tl.exp2(m_i - m_all) / denom)[:, None]
            tl.store(O + t.to(tl.int64) * so_t + heads[:, None] * so_h + d[None, :], out, mask=omask)
        else:
            tl.store(O + t.to(tl.int64) * so_t + sp * so_s + heads[:, None] * so_h + d[None, :], acc, mask=omask)
            tl.store(ML + t.to(tl.int64) * sml_t + sp * sml_s + heads, m_i, mask=hmask)
            tl.store(ML + t.to(tl.int64) * sml_t + sp * sml_s + H + heads, l_i, mask=hmask)


@triton.jit
def combine_kernel(
    PART, sp_t, sp_s, sp_h, ML, sml_t, sml_s, O, so_t, so_h, POS, SINK, H, K_IDX, split_rows,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WINDOW: tl.constexpr,
    MODE: tl.constexpr, RATIO: tl.constexpr, PDL: tl.constexpr,
):
    """Merge the pieces of one token for BLOCK_H heads × BLOCK_D dims with the sink, BLOCK_S pieces
    at a time in a fixed order, in one pass with a running maximum M:
    o = Σ_s acc_s 2^(m_s−M) / (Σ_s l_s 2^(m_s−M) + 2^(sink−M))."""
    wait_then_release(PDL)
    t = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dd = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    pos = tl.load(POS + t)
    if MODE == 1:
        n_comp = K_IDX
    elif MODE == 2:
        n_comp = (pos + 1) // RATIO
    else:
        n_comp = 0
    n_split = (WINDOW + n_comp + split_rows - 1) // split_rows
    hmask = heads < H
    dmask = dd < D
    m_run = tl.load(SINK + heads, mask=hmask, other=0.0) * 1.4426950408889634    # the sink starts the merge
    denom = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    base = ML + t.to(tl.int64) * sml_t
    for s0 in range(0, n_split, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        sm = (s < n_split)[:, None] & hmask[None, :]
        m = tl.load(base + s[:, None] * sml_s + heads[None, :], mask=sm, other=float("-inf"))
        l = tl.load(base + s[:, None] * sml_s + H + heads[None, :], mask=sm, other=0.0)
        part = tl.load(PART + t.to(tl.int64) * sp_t + s[:, None, None] * sp_s + heads[None, :, None] * sp_h
                       + dd[None, None, :], mask=sm[:, :, None] & dmask[None, None, :], other=0.0).to(tl.float32)
        m_new = tl.maximum(m_run, tl.max(m, 0))                       # finite: it includes the sink
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new[None, :])
        denom = denom * alpha + tl.sum(l * w, 0)
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 0)
        m_run = m_new
    tl.store(O + t.to(tl.int64) * so_t + heads[:, None] * so_h + dd[None, :], acc / denom[:, None],
             mask=hmask[:, None] & dmask[None, :])


# ----------------------------------------------------------------------------- launchers
import functools  # noqa: E402

import torch  # noqa: E402

from hybridkv.ops.backend import is_deterministic  # noqa: E402
from hybridkv.ops.pdl import triton_args

# Launch shapes (BLOCK_H, BLOCK_N, split rows, num_warps, num_stages), from a sweep of shapes on the
# H200 at V4-Flash dims (BENCHMARKS.md). Deterministic mode: one fixed shape for every token.
# Prefill: all 64 heads of a token per program (wgmma, M = 64), one piece per token, 64-row tiles;
# packed fp8 rows without software pipelining (their dequantisation already fills the registers:
# 1.4-2.1x faster than two stages). Decode: 16-head programs ("narrow", each row tile re-read per
# head block from L2) for little work; whole-head programs ("wide", no re-reads) once tokens × rows
# reach WIDE_ROWS_PER_SM per SM, each piece ≥ MIN_SPLIT rows and about one piece per SM (CSA at 1M,
# B=8: 39 µs against 71 µs narrow; HCA at 1M, B=1: 50 against 85 µs). Decode programs are short
# serial chains of dependent loads and MMAs on one SM each, so: no software pipelining (HCA at 1M,
# B=8: 107 against 148 µs with two stages; narrow CSA at 1M, B=1: 15 against 22 µs), pieces down to
# one 32-row tile (CSA at 8K, B=1: 23 against 29 µs with 64-row pieces), wide programs on 64-row
# tiles (HCA at 1M, B=8: 89 against 100 µs with 32-row tiles, though ptxas spills 8 B). These were
# measured on packed fp8 rows; bf16 rows keep two stages and 32-row wide tiles (one stage spills
# ~570 B there, 64-row tiles ~700 B: benchmarks/kernel_resources.py). The merge:
# one warp per head × 64 dims, 32 pieces at a time (HCA at 1M, B=1: 34 against 44 µs with 4 heads ×
# 64 dims per 4 warps).
DETERMINISTIC_CFG = (16, 32, 256, 8, 2)
PREFILL_CFG = {False: (64, 64, 8, 2), True: (64, 64, 8, 1)}    # by fp8: BLOCK_H, BLOCK_N, warps, stages
NARROW_CFG = {False: (16, 32, 8, 2), True: (16, 32, 8, 1)}     # by fp8: BLOCK_H, BLOCK_N, warps, stages
WIDE_CFG = {False: (64, 32, 8, 2), True: (64, 64, 8, 1)}
PIECES_PER_SM = 2                                # narrow decode programs per SM to aim for
MIN_SPLIT = 32
WIDE_ROWS_PER_SM = 32
COMBINE_CFG = dict(BLOCK_H=1, BLOCK_D=64, BLOCK_S=32, num_warps=1)
# A split's unnormalised output is stored in bf16 when the queries are bf16 (outside deterministic
# mode): in float32 a piece's 64 heads × 512 dims weigh 128 KiB, as much as 224 packed fp8 rows, so
# HCA at 1M, B=1 wrote 17 MB of partials for 4.9 MB of rows. bf16 keeps 8 bits of each partial's
# significand, as many as the bf16 attention output they are merged into.
PARTIALS_IN_BF16 = True


@functools.lru_cache(maxsize=8)
def _dummy(device: torch.device) -> torch.Tensor:
    """A placeholder int32 argument for pointers a launch never reads (cached: no fill per call)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=8)
def _sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _config(num_tokens: int, rows_max: int, heads: int, device, fp8: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_H, BLOCK_N, split_rows, num_warps, num_stages) for a launch of num_tokens tokens whose
    longest row list has rows_max rows."""
    if is_deterministic():
        return DETERMINISTIC_CFG
    if num_tokens > 64:
        bh, bn, warps, stages = PREFILL_CFG[fp8]
        return min(bh, max(16, triton.next_power_of_2(heads))), bn, triton.cdiv(rows_max, bn) * bn, warps, stages
    sms = _sms(device)
    wide = heads >= WIDE_CFG[fp8][0] and num_tokens * rows_max >= WIDE_ROWS_PER_SM * sms
    bh, bn, warps, stages = WIDE_CFG[fp8] if wide else NARROW_CFG[fp8]
    want = max(1, (sms if wide else PIECES_PER_SM * sms) // (num_tokens * triton.cdiv(heads, bh)))
    split = max(MIN_SPLIT, triton.cdiv(triton.cdiv(rows_max, want), bn) * bn)
    return bh, bn, split, warps, stages


def _words(x: torch.Tensor | None) -> torch.Tensor | None:
    """Packed uint8 entries viewed as int32 words (the row length is a multiple of 8 bytes)."""
    if x is None:
        return None
    if x.shape[-1] % 4 or x.stride(-1) != 1 or x.data_ptr() % 4:
        x = x.contiguous()
    return x.view(torch.int32)


FORMAT_CODES = {"bf16": 0, "fp8": 1, "v41": 2}     # the kernels' FMT: float elements, V4 packed, V4.1 packed


def _bytes(x: torch.Tensor | None) -> torch.Tensor | None:
    """Packed uint8 rows as int8 (the kernels bitcast bytes to e4m3), each row contiguous."""
    if x is None:
        return None
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.view(torch.int8)


def _launch(q, sink, scale, new_kv, ring, pool, block_tables, idx, token_req, positions, slots,
            seg_start, seg_row0, window, mode, ratio, epb, paged, fmt, head_dim, rope_dim, max_pos, cfg=None,
            out_dtype=torch.float32, out=None, like_tokens=None):
    t, h, _ = q.shape
    dev = q.device
    block_d = triton.next_power_of_2(head_dim)
    fmt_code = FORMAT_CODES[fmt]
    fp8 = fmt_code == 1
    if fp8:
        assert rope_dim == 64 and head_dim == block_d >= 128, "packed fp8 entries: 64 rope dims, head_dim 2^k ≥ 128"
        new_kv, ring, pool = _words(new_kv), _words(ring), _words(pool)
    elif fmt_code == 2:
        assert head_dim == block_d >= 32, "packed V4.1 rows: head_dim 2^k ≥ 32"
        new_kv, ring, pool = _bytes(new_kv), _bytes(ring), _bytes(pool)
    k_idx = idx.shape[1] if mode == 1 else 0
    if mode == 1:
        n_comp_max = k_idx
    elif mode == 2:
        n_comp_max = (max_pos + 1) // ratio
    else:
        n_comp_max = 0
    rows_max = window + n_comp_max
    bh, bn, split, warps, stages = cfg or _config(like_tokens or t, rows_max, h, dev, fmt_code > 0)
    n_split = max(1, triton.cdiv(rows_max, split))
    if out is None:
        out = torch.empty(t, h, head_dim, dtype=out_dtype, device=dev)     # (stores round float32 to it)
    if t == 0:
        return out
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dummy = _dummy(dev)
    idx_t = idx if mode == 1 else dummy
    new_t = new_kv if new_kv is not None else pool
    ring_t = ring if ring is not None else pool
    # (one loop reads window and pool rows alike: V4.1's two row formats need the two loops)
    common = dict(D=head_dim, ROPE=rope_dim, BLOCK_D=block_d, BLOCK_H=bh, BLOCK_N=bn, FMT=fmt_code, WINDOW=window,
                  MODE=mode, RATIO=max(ratio, 1), EPB=epb, PAGED=paged, PREC=prec, TWO_LOOPS=not (fp8 and bh >= 64))
    args_tail = (new_t, new_t.stride(0), ring_t, ring_t.stride(0) if ring is not None else 0,
                 ring_t.stride(1) if ring is not None else 0, pool, pool.stride(0),
                 block_tables if block_tables is not None else dummy,
                 block_tables.stride(0) if block_tables is not None else 0, idx_t, idx_t.stride(0) if mode == 1 else 0,
                 token_req, positions, slots, seg_start, seg_row0, sink, scale * LOG2E, h, k_idx, split)
    grid = (t, triton.cdiv(h, bh), n_split)
    if n_split == 1:
        sparse_attn_kernel[grid](q, q.stride(0), q.stride(1), out, out.stride(0), 0, out.stride(1), dummy, 0, 0,
                                 *args_tail, FINAL=True, num_warps=warps, num_stages=stages, **common, **triton_args(q))
        return out
    part_dtype = torch.bfloat16 if (PARTIALS_IN_BF16 and q.dtype == torch.bfloat16 and not is_deterministic()) \
        else torch.float32
    part = torch.empty(t, n_split, h, head_dim, dtype=part_dtype, device=dev)
    ml = torch.empty(t, n_split, 2, h, dtype=torch.float32, device=dev)
    sparse_attn_kernel[grid](q, q.stride(0), q.stride(1), part, part.stride(0), part.stride(1), part.stride(2),
                             ml, ml.stride(0), ml.stride(1), *args_tail, FINAL=False, num_warps=warps,
                             num_stages=stages, **common, **triton_args(q))
    c = COMBINE_CFG
    bhc, bdc = min(c["BLOCK_H"], max(2, triton.next_power_of_2(h))), min(c["BLOCK_D"], triton.next_power_of_2(head_dim))
    combine_kernel[(t, triton.cdiv(h, bhc), triton.cdiv(head_dim, bdc))](
        part, part.stride(0), part.stride(1), part.stride(2), ml, ml.stride(0), ml.stride(1), out, out.stride(0),
        out.stride(1), positions, sink, h, k_idx, split, D=head_dim, BLOCK_H=bhc, BLOCK_D=bdc, BLOCK_S=c["BLOCK_S"],
        WINDOW=window, MODE=mode, RATIO=max(ratio, 1), num_warps=c["num_warps"], **triton_args(part))
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float,
                cfg=None, like_tokens=None) -> torch.Tensor:
    """Contiguous variant, same contract as the reference: q [T, H, D], kv [N, D], idx [T, K]."""
    t = q.shape[0]
    z = torch.zeros(t, dtype=torch.int32, device=q.device)
    return _launch(q, sink.float().contiguous(), scale, None, None, kv, None, idx.to(torch.int32), z,
                   z, z, z, z, window=0, mode=1, ratio=0, epb=1, paged=False, fmt="bf16", head_dim=kv.shape[1],
                   rope_dim=0, max_pos=0, cfg=cfg, like_tokens=like_tokens)


def sparse_attn_paged(q, sink, scale, batch, new_kv, ring, pool, idx=None, ratio=0, fmt="bf16", head_dim=None,
                      rope_dim=0, window=128, max_pos=None, cfg=None, out_dtype=torch.float32, out=None,
                      like_tokens=None):
    """See `hybridkv.ops.sparse_attn.sparse_attn_paged`. `cfg` overrides the launch shape
    (BLOCK_H, BLOCK_N, split rows, num_warps, num_stages)."""
    mode = 1 if idx is not None else (2 if ratio else 0)
    epb = batch.block_tokens // ratio if ratio else 1
    pool_flat = pool.reshape(-1, pool.shape[-1]) if pool is not None else new_kv
    if mode == 2 and max_pos is None:
        max_pos = int(batch.positions.max())  # a host sync: pass max_pos under CUDA graphs
    return _launch(q, sink.float().contiguous(), scale, new_kv, ring, pool_flat, batch.block_tables,
                   None if idx is None else idx.to(torch.int32), batch.token_req, batch.positions, batch.slots,
                   batch.seg_start, batch.seg_row0, window=window, mode=mode, ratio=ratio, epb=epb, paged=True,
                   fmt=fmt, head_dim=head_dim, rope_dim=rope_dim, max_pos=max_pos or 0, cfg=cfg, out_dtype=out_dtype,
                   out=out, like_tokens=like_tokens)
