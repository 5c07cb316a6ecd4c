"""Triton kernels for the Lightning Indexer: scores of every visible compressed entry, then an
exact causal top-k by radix select, returned in ascending entry order (what attention consumes).

1. `score_kernel`: a tile of query tokens of one request × a chunk of its visible keys (bf16/fp32
   rows, or 68-B packed FP4 rows dequantised in registers); `Σ_h w_h·ReLU(q_h·k)` as a GEMM over
   (tokens·heads) × keys; writes an order-preserving uint32 key per score and, for one-token tiles,
   the histogram of its top 8 bits.
2. `hist_kernel` (levels 1–3): the histogram of the next 8 bits among keys that share the prefix
   found so far; each program re-derives the prefix from the histograms (integer counts: the
   result is exact and deterministic whatever the atomics' order).
3. `count_kernel` and `write_kernel`: with the threshold key τ and the number r of τ-ties to keep,
   every chunk counts its keys > τ and = τ; a chunk writes its selected entries at the exclusive
   prefix of the earlier chunks' counts. Ties at τ are broken by entry order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import is_deterministic
from hybridkv.ops.paged import PagedBatch

NBINS = 256


@triton.jit
def _load_keys(ptr, d, valid, D: tl.constexpr, FP4: tl.constexpr):
    """Rows [BN, BD] as float32 from row base pointers [BN]; FP4 rows are D/2 code bytes then D/32
    ue8m0 scales."""
    p = ptr[:, None]
    v = valid[:, None] & (d < D)[None, :]
    if FP4:
        byte = tl.load(p + d[None, :] // 2, mask=v, other=0).to(tl.int32)
        code = (byte >> ((d[None, :] % 2) * 4)) & 15
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        pow2 = ((e + 125) << 23).to(tl.float32, bitcast=True)          # 2^(e-2)
        mag = tl.where(e == 0, m * 0.5, (2.0 + m) * pow2)
        val = tl.where(code >= 8, -mag, mag)
        sb = tl.load(p + D // 2 + d[None, :] // 32, mask=v, other=127).to(tl.int32)
        return val * (sb << 23).to(tl.float32, bitcast=True)
    else:
        return tl.load(p + d[None, :], mask=v, other=0.0).to(tl.float32)


@triton.jit
def score_kernel(Q, sq_t, sq_h, W, sw_t, POOL, s_pool_row, BT, s_bt, TOK_REQ, VIS, TILE_T0, TILE_N, KEYS, s_keys,
                 HIST, s_hist, H, T,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, FP4: tl.constexpr, PAGED: tl.constexpr,
                 EPB: tl.constexpr, FUSE_HIST: tl.constexpr, PREC: tl.constexpr):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    t0 = tl.load(TILE_T0 + tile)
    nt = tl.load(TILE_N + tile)
    ti = tl.arange(0, BLOCK_T)
    tmask = ti < nt
    vis_t = tl.load(VIS + t0 + ti, mask=tmask, other=0)
    vis_max = tl.max(vis_t, 0)
    n_start = chunk * CHUNK
    if n_start < vis_max:
        r = tl.load(TOK_REQ + t0).to(tl.int64)
        mrow = tl.arange(0, BLOCK_T * BLOCK_H)
        tok = t0 + mrow // BLOCK_H
        h = mrow % BLOCK_H
        rmask = (mrow // BLOCK_H < nt) & (h < H)
        d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + tok.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                    mask=rmask[:, None] & (d < D)[None, :], other=0.0)
        w = tl.load(W + tok.to(tl.int64) * sw_t + h, mask=rmask, other=0.0).to(tl.float32)
        hist = tl.zeros([256], tl.int32)
        end = tl.minimum(n_start + CHUNK, vis_max)
        for n0 in range(n_start, end, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            jv = j < end
            if PAGED:
                blk = tl.load(BT + r * s_bt + j // EPB, mask=jv, other=0)
                row = blk.to(tl.int64) * EPB + j % EPB
            else:
                row = j.to(tl.int64)
            k = _load_keys(POOL + row * s_pool_row, d, jv, D, FP4).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)
            s = tl.maximum(s, 0.0) * w[:, None]
            sc = tl.sum(tl.reshape(s, [BLOCK_T, BLOCK_H, BLOCK_N]), 1) + 0.0   # + 0.0 maps −0 to +0
            u = sc.to(tl.uint32, bitcast=True)
            key = tl.where((u >> 31) != 0, u ^ 0xFFFFFFFF, u | 0x80000000)
            valid = tmask[:, None] & (j[None, :] < vis_t[:, None])
            tl.store(KEYS + (t0 + ti).to(tl.int64)[:, None] * s_keys + j[None, :], key.to(tl.int32, bitcast=True),
                     mask=tmask[:, None] & jv[None, :])
            if FUSE_HIST:
                hist += tl.histogram(tl.reshape(key >> 24, [BLOCK_N]).to(tl.int32), 256,
                                     mask=tl.reshape(valid, [BLOCK_N]))
        if FUSE_HIST:
            tl.atomic_add(HIST + t0.to(tl.int64) * s_hist + tl.arange(0, 256), hist)


@triton.jit
def _threshold(hist_ptr, LEVELS: tl.constexpr, K):
    """(prefix of the k-th largest key after LEVELS digits, how many keys equal to it to keep)."""
    b = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    krem = K
    for lvl in tl.static_range(LEVELS):
        hcount = tl.load(hist_ptr + lvl * 256 + b)
        suffix = tl.sum(hcount, 0) - tl.cumsum(hcount, 0) + hcount      # keys in bins ≥ b
        bsel = tl.max(tl.where(suffix >= krem, b, -1), 0)
        krem = krem - tl.sum(tl.where(b > bsel, hcount, 0), 0)
        prefix = (prefix << 8) | bsel.to(tl.uint32)
    return prefix, krem


@triton.jit
def hist_kernel(KEYS, s_keys, HIST, s_hist, VIS, K, LEVEL: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    vis = tl.load(VIS + t)
    if (vis > K) & (c * CHUNK < vis):
        hp = HIST + t.to(tl.int64) * s_hist
        prefix, krem = _threshold(hp, LEVEL, K)
        hist = tl.zeros([256], tl.int32)
        end = tl.minimum(c * CHUNK + CHUNK, vis)
        for n0 in range(c * CHUNK, end, BLOCK):
            j = n0 + tl.arange(0, BLOCK)
            m = j < end
            key = tl.load(KEYS + t.to(tl.int64) * s_keys + j, mask=m, other=0).to(tl.uint32, bitcast=True)
            if LEVEL > 0:
                m = m & ((key >> (32 - 8 * LEVEL)) == prefix)
            hist += tl.histogram(((key >> (24 - 8 * LEVEL)) & 255).to(tl.int32), 256, mask=m)
        tl.atomic_add(hp + LEVEL * 256 + tl.arange(0, 256), hist)


@triton.jit
def count_kernel(KEYS, s_keys, HIST, s_hist, COUNTS, s_cnt, VIS, K, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    vis = tl.load(VIS + t)
    if (vis > K) & (c * CHUNK < vis):
        tau, krem = _threshold(HIST + t.to(tl.int64) * s_hist, 4, K)
        gt = 0
        eq = 0
        end = tl.minimum(c * CHUNK + CHUNK, vis)
        for n0 in range(c * CHUNK, end, BLOCK):
            j = n0 + tl.arange(0, BLOCK)
            m = j < end
            key = tl.load(KEYS + t.to(tl.int64) * s_keys + j, mask=m, other=0).to(tl.uint32, bitcast=True)
            gt += tl.sum((m & (key > tau)).to(tl.int32), 0)
            eq += tl.sum((m & (key == tau)).to(tl.int32), 0)
        tl.store(COUNTS + t.to(tl.int64) * s_cnt + 2 * c, gt)
        tl.store(COUNTS + t.to(tl.int64) * s_cnt + 2 * c + 1, eq)


@triton.jit
def write_kernel(KEYS, s_keys, HIST, s_hist, COUNTS, s_cnt, VIS, OUT, s_out, K, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, NCH: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    vis = tl.load(VIS + t)
    out = OUT + t.to(tl.int64) * s_out
    end = tl.minimum(c * CHUNK + CHUNK, vis)
    if vis <= K:
        for n0 in range(c * CHUNK, end, BLOCK):
            j = n0 + tl.arange(0, BLOCK)
            tl.store(out + j, j, mask=j < end)
    elif c * CHUNK < vis:
        tau, krem = _threshold(HIST + t.to(tl.int64) * s_hist, 4, K)
        ch = tl.arange(0, NCH)
        before = ch < c
        gt_before = tl.sum(tl.load(COUNTS + t.to(tl.int64) * s_cnt + 2 * ch, mask=before, other=0), 0)
        eq_seen = tl.sum(tl.load(COUNTS + t.to(tl.int64) * s_cnt + 2 * ch + 1, mask=before, other=0), 0)
        base = gt_before + tl.minimum(eq_seen, krem)
        for n0 in range(c * CHUNK, end, BLOCK):
            j = n0 + tl.arange(0, BLOCK)
            m = j < end
            key = tl.load(KEYS + t.to(tl.int64) * s_keys + j, mask=m, other=0).to(tl.uint32, bitcast=True)
            is_eq = (m & (key == tau)).to(tl.int32)
            eq_rank = eq_seen + tl.cumsum(is_eq, 0) - is_eq
            sel = ((m & (key > tau)) | ((is_eq != 0) & (eq_rank < krem))).to(tl.int32)
            dst = base + tl.cumsum(sel, 0) - sel
            tl.store(out + dst, j, mask=sel != 0)
            base += tl.sum(sel, 0)
            eq_seen += tl.sum(is_eq, 0)


# ----------------------------------------------------------------------------- launchers
SCORE_CHUNK = 2048      # keys per scoring program
SELECT_CHUNK = 8192     # keys per selection program
SCORE_BUFFER = 1 << 28  # bytes of uint32 keys held at once (tokens are processed in groups)


def _tiles(token_req: torch.Tensor, block_t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tiles of ≤ block_t consecutive tokens of one request: (first token, count)."""
    t = token_req.shape[0]
    if block_t == 1:
        return (torch.arange(t, dtype=torch.int32, device=token_req.device),
                torch.ones(t, dtype=torch.int32, device=token_req.device))
    req = token_req.tolist()
    t0, n = [], []
    i = 0
    while i < t:
        j = i
        while j < t and j - i < block_t and req[j] == req[i]:
            j += 1
        t0.append(i)
        n.append(j - i)
        i = j
    dev = token_req.device
    return torch.tensor(t0, dtype=torch.int32, device=dev), torch.tensor(n, dtype=torch.int32, device=dev)


def _run(q, weights, pool_flat, row_stride, block_tables, token_req, vis, topk, n_max, fp4, paged, epb, head_dim,
         block_t=None):
    t, h, _ = q.shape
    dev = q.device
    out = torch.full((t, topk), -1, dtype=torch.int32, device=dev)
    if t == 0 or n_max == 0:
        return out
    block_h = max(16, triton.next_power_of_2(h))
    block_d = triton.next_power_of_2(head_dim)
    if block_t is None:
        # one-token tiles for decode, and always in deterministic mode (the score of a token must not
        # depend on the tile shape its batch happens to give it)
        block_t = 1 if t <= 64 or is_deterministic() else max(1, 256 // block_h)
    group = max(block_t, (SCORE_BUFFER // (4 * n_max)) // block_t * block_t)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    score_chunk = min(SCORE_CHUNK, max(64, triton.next_power_of_2(n_max)))
    sel_chunk = min(SELECT_CHUNK, max(64, triton.next_power_of_2(n_max)))
    nch = triton.cdiv(n_max, sel_chunk)
    bt = block_tables if block_tables is not None else out
    for a in range(0, t, group):
        b = min(t, a + group)
        tn = b - a
        keys = torch.empty(tn, n_max, dtype=torch.int32, device=dev)
        hist = torch.zeros(tn, 4, NBINS, dtype=torch.int32, device=dev)
        counts = torch.empty(tn, nch, 2, dtype=torch.int32, device=dev)
        tile_t0, tile_n = _tiles(token_req[a:b], block_t)
        fuse = block_t == 1
        score_kernel[(tile_t0.shape[0], triton.cdiv(n_max, score_chunk))](
            q[a:b], q.stride(0), q.stride(1), weights[a:b], weights.stride(0), pool_flat, row_stride, bt, bt.stride(0),
            token_req[a:b], vis[a:b], tile_t0, tile_n, keys, keys.stride(0), hist, hist.stride(0), h, tn,
            D=head_dim, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_N=64, CHUNK=score_chunk, FP4=fp4,
            PAGED=paged, EPB=epb, FUSE_HIST=fuse, PREC=prec, num_warps=4 if block_t * block_h <= 64 else 8)
        grid = (tn, nch)
        for level in range(0 if not fuse else 1, 4):
            hist_kernel[grid](keys, keys.stride(0), hist, hist.stride(0), vis[a:b], topk, LEVEL=level,
                              CHUNK=sel_chunk, BLOCK=1024 if sel_chunk >= 1024 else sel_chunk)
        count_kernel[grid](keys, keys.stride(0), hist, hist.stride(0), counts, counts.stride(0), vis[a:b], topk,
                           CHUNK=sel_chunk, BLOCK=1024 if sel_chunk >= 1024 else sel_chunk)
        write_kernel[grid](keys, keys.stride(0), hist, hist.stride(0), counts, counts.stride(0), vis[a:b], out[a:b],
                           out.stride(0), topk, CHUNK=sel_chunk, BLOCK=1024 if sel_chunk >= 1024 else sel_chunk,
                           NCH=max(2, triton.next_power_of_2(nch)))
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
                1, keys.shape[1])


def indexer_topk_paged(q, weights, batch: PagedBatch, pool, topk, ratio=4, fmt="bf16", head_dim=None, max_visible=None):
    """See `hybridkv.ops.indexer_topk.indexer_topk_paged`."""
    epb = batch.block_tokens // ratio
    vis = ((batch.positions + 1) // ratio).to(torch.int32)
    if max_visible is None:
        max_visible = int(vis.max()) if vis.numel() else 0   # a host sync: pass it under CUDA graphs
    flat = pool.reshape(-1, pool.shape[-1])
    return _run(q, weights, flat, flat.stride(0), batch.block_tables, batch.token_req, vis, topk, max_visible,
                fmt == "fp4", True, epb, head_dim or q.shape[-1])
