"""Triton kernels for sparse attention with a sink: one query token × a block of heads per program,
over a virtual row list = the window rows of the token, then its compressed rows.

Rows come from three places, chosen per row: the chunk's own new rows (positions ≥ the chunk
start), the request's window ring (earlier positions, ring row pos % window) and the compressed
pool (CSA: the entries of the token's index list; HCA: every entry j < (pos+1)//ratio). Packed fp8
entries (584 B) are dequantised in registers: e4m3 nope bytes × their ue8m0 tile scale, bf16 rope.

Work is split along the row list in fixed `split_rows` pieces (flash-decoding); a second kernel
merges the pieces in a fixed order together with the sink. The split size never depends on the
batch, so a token's result does not depend on what else is in the batch.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _load_kv(ptr, d, valid, D: tl.constexpr, ROPE: tl.constexpr, FP8: tl.constexpr):
    """Rows [BN, BD] as float32 from row base pointers `ptr` [BN] (bytes for FP8, else elements)."""
    NOPE: tl.constexpr = D - ROPE
    p = ptr[:, None]
    v = valid[:, None]
    if FP8:
        in_nope = (d < NOPE)[None, :]
        code = tl.load(p + d[None, :], mask=v & in_nope, other=0)
        nope = code.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        e = tl.load(p + (NOPE + 2 * ROPE) + d[None, :] // 64, mask=v & in_nope, other=127)
        scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        r = d[None, :] - NOPE
        in_rope = (r >= 0) & (r < ROPE)
        lo = tl.load(p + NOPE + 2 * r, mask=v & in_rope, other=0).to(tl.int32)
        hi = tl.load(p + NOPE + 2 * r + 1, mask=v & in_rope, other=0).to(tl.int32)
        rope = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)
        return tl.where(in_nope, nope * scale, rope)
    else:
        return tl.load(p + d[None, :], mask=v & (d < D)[None, :], other=0.0).to(tl.float32)


@triton.jit
def sparse_attn_kernel(
    Q, sq_t, sq_h, O, so_t, so_s, so_h, ML, sml_t, sml_s,
    NEW, s_new, RING, s_ring_slot, s_ring_row, POOL, s_pool_row, BT, s_bt, IDX, s_idx,
    TOK_REQ, POS, SLOTS, SEG_START, SEG_ROW0, SINK, scale_log2, H, K_IDX,
    D: tl.constexpr, ROPE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, WINDOW: tl.constexpr, MODE: tl.constexpr, RATIO: tl.constexpr, EPB: tl.constexpr,
    PAGED: tl.constexpr, SPLIT_ROWS: tl.constexpr, FINAL: tl.constexpr, PREC: tl.constexpr,
):
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
    start = sp * SPLIT_ROWS
    if start < total:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < H
        d = tl.arange(0, BLOCK_D)
        q = tl.load(Q + t.to(tl.int64) * sq_t + heads[:, None] * sq_h + d[None, :],
                    mask=hmask[:, None] & (d < D)[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        if WINDOW > 0:
            seg_start = tl.load(SEG_START + r)
            seg_row0 = tl.load(SEG_ROW0 + r)
            slot = tl.load(SLOTS + r).to(tl.int64)
        end = tl.minimum(start + SPLIT_ROWS, total)
        for n0 in range(start, end, BLOCK_N):
            v = n0 + tl.arange(0, BLOCK_N)
            c = v - WINDOW
            # compressed rows
            if MODE == 1:
                j = tl.load(IDX + t.to(tl.int64) * s_idx + c, mask=(c >= 0) & (c < n_comp), other=-1)
            else:
                j = tl.where((c >= 0) & (c < n_comp), c, -1)
            if PAGED:
                blk = tl.load(BT + r.to(tl.int64) * s_bt + tl.maximum(j, 0) // EPB, mask=j >= 0, other=0)
                row = blk.to(tl.int64) * EPB + tl.maximum(j, 0) % EPB
            else:
                row = tl.maximum(j, 0).to(tl.int64)
            ptr = POOL + row * s_pool_row
            valid = j >= 0
            if WINDOW > 0:
                p = pos - (WINDOW - 1) + v
                in_win = v < WINDOW
                is_new = p >= seg_start
                new_ptr = NEW + (seg_row0 + tl.maximum(p - seg_start, 0)).to(tl.int64) * s_new
                ring_ptr = RING + slot * s_ring_slot + (tl.maximum(p, 0) % WINDOW).to(tl.int64) * s_ring_row
                ptr = tl.where(in_win, tl.where(is_new, new_ptr, ring_ptr), ptr)
                valid = tl.where(in_win, p >= 0, valid)
            valid = valid & (v < end)
            kv = _load_kv(ptr, d, valid, D, ROPE, FP8).to(q.dtype)
            s = tl.dot(q, tl.trans(kv), input_precision=PREC) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            acc = acc * alpha[:, None] + tl.dot(pr.to(kv.dtype), kv, input_precision=PREC)
            m_i = m_new
        omask = hmask[:, None] & (d < D)[None, :]
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
    PART, sp_t, sp_s, sp_h, ML, sml_t, sml_s, O, so_t, so_h, POS, SINK, H, K_IDX,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, WINDOW: tl.constexpr, MODE: tl.constexpr,
    RATIO: tl.constexpr, SPLIT_ROWS: tl.constexpr,
):
    """Merge the row pieces of one token (fixed order) with the sink: o = Σ acc_s 2^(m_s−M) / L."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    pos = tl.load(POS + t)
    if MODE == 1:
        n_comp = K_IDX
    elif MODE == 2:
        n_comp = (pos + 1) // RATIO
    else:
        n_comp = 0
    n_split = (WINDOW + n_comp + SPLIT_ROWS - 1) // SPLIT_ROWS
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    d = tl.arange(0, BLOCK_D)
    sink = tl.load(SINK + heads, mask=hmask, other=0.0) * 1.4426950408889634
    m_all = sink
    base = ML + t.to(tl.int64) * sml_t
    for s in range(0, n_split):
        m_all = tl.maximum(m_all, tl.load(base + s * sml_s + heads, mask=hmask, other=float("-inf")))
    denom = tl.exp2(sink - m_all)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    omask = hmask[:, None] & (d < D)[None, :]
    for s in range(0, n_split):
        m_s = tl.load(base + s * sml_s + heads, mask=hmask, other=float("-inf"))
        l_s = tl.load(base + s * sml_s + H + heads, mask=hmask, other=0.0)
        w = tl.exp2(m_s - m_all)
        denom += l_s * w
        part = tl.load(PART + t.to(tl.int64) * sp_t + s * sp_s + heads[:, None] * sp_h + d[None, :], mask=omask,
                       other=0.0)
        acc += part * w[:, None]
    tl.store(O + t.to(tl.int64) * so_t + heads[:, None] * so_h + d[None, :], acc / denom[:, None], mask=omask)


# ----------------------------------------------------------------------------- launchers
import torch  # noqa: E402

from hybridkv.ops.backend import is_deterministic  # noqa: E402


def _config(num_tokens: int, rows_max: int, heads: int, block_d: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_N, split_rows, num_warps). Few tokens (decode): small head blocks, rows split
    over many programs; many tokens (prefill): one piece per token, all heads of a block at once.
    Deterministic mode always takes the decode configuration, so a token's reduction order never
    depends on how many other tokens share the launch."""
    bn = 32 if block_d >= 256 else 64
    if num_tokens <= 64 or is_deterministic():
        return 16, bn, 64, 4
    bh = 64 if heads >= 64 else 16
    return bh, bn, max(bn, triton.cdiv(rows_max, bn) * bn), 8 if bh >= 64 else 4


def _launch(q, sink, scale, new_kv, ring, pool, pool_row_stride, block_tables, idx, token_req, positions, slots,
            seg_start, seg_row0, window, mode, ratio, epb, paged, fp8, head_dim, rope_dim, max_pos):
    t, h, _ = q.shape
    dev = q.device
    k_idx = idx.shape[1] if mode == 1 else 0
    if mode == 1:
        n_comp_max = k_idx
    elif mode == 2:
        n_comp_max = (max_pos + 1) // ratio
    else:
        n_comp_max = 0
    rows_max = window + n_comp_max
    block_d = triton.next_power_of_2(head_dim)
    bh, bn, split, warps = _config(t, rows_max, h, block_d)
    n_split = max(1, triton.cdiv(rows_max, split))
    out = torch.empty(t, h, head_dim, dtype=torch.float32, device=dev)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    dummy = torch.zeros(1, dtype=torch.int32, device=dev)
    idx_t = idx if mode == 1 else dummy
    new_t = new_kv if new_kv is not None else pool
    ring_t = ring if ring is not None else pool
    common = dict(D=head_dim, ROPE=rope_dim, BLOCK_D=block_d, BLOCK_H=bh, BLOCK_N=bn, FP8=fp8, WINDOW=window,
                  MODE=mode, RATIO=max(ratio, 1), EPB=epb, PAGED=paged, SPLIT_ROWS=split, PREC=prec)
    args_tail = (new_t, new_t.stride(0), ring_t, ring_t.stride(0) if ring is not None else 0,
                 ring_t.stride(1) if ring is not None else 0, pool, pool_row_stride,
                 block_tables if block_tables is not None else dummy,
                 block_tables.stride(0) if block_tables is not None else 0, idx_t, idx_t.stride(0) if mode == 1 else 0,
                 token_req, positions, slots, seg_start, seg_row0, sink, scale * LOG2E, h, k_idx)
    grid = (t, triton.cdiv(h, bh), n_split)
    if n_split == 1:
        sparse_attn_kernel[grid](q, q.stride(0), q.stride(1), out, out.stride(0), 0, out.stride(1), dummy, 0, 0,
                                 *args_tail, FINAL=True, num_warps=warps, num_stages=2, **common)
        return out
    part = torch.empty(t, n_split, h, head_dim, dtype=torch.float32, device=dev)
    ml = torch.empty(t, n_split, 2, h, dtype=torch.float32, device=dev)
    sparse_attn_kernel[grid](q, q.stride(0), q.stride(1), part, part.stride(0), part.stride(1), part.stride(2),
                             ml, ml.stride(0), ml.stride(1), *args_tail, FINAL=False, num_warps=warps, num_stages=2,
                             **common)
    combine_kernel[(t, triton.cdiv(h, bh))](part, part.stride(0), part.stride(1), part.stride(2), ml, ml.stride(0),
                                            ml.stride(1), out, out.stride(0), out.stride(1), positions, sink, h, k_idx,
                                            D=head_dim, BLOCK_D=block_d, BLOCK_H=bh, WINDOW=window, MODE=mode,
                                            RATIO=max(ratio, 1), SPLIT_ROWS=split, num_warps=4)
    return out


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """Contiguous variant, same contract as the reference: q [T, H, D], kv [N, D], idx [T, K]."""
    t = q.shape[0]
    z = torch.zeros(t, dtype=torch.int32, device=q.device)
    return _launch(q, sink.float().contiguous(), scale, None, None, kv, kv.stride(0), None, idx.to(torch.int32), z,
                   z, z, z, z, window=0, mode=1, ratio=0, epb=1, paged=False, fp8=False, head_dim=kv.shape[1],
                   rope_dim=0, max_pos=0)


def sparse_attn_paged(q, sink, scale, batch, new_kv, ring, pool, idx=None, ratio=0, fmt="bf16", head_dim=None,
                      rope_dim=0, window=128, max_pos=None):
    """See `hybridkv.ops.sparse_attn.sparse_attn_paged`."""
    fp8 = fmt == "fp8"
    mode = 1 if idx is not None else (2 if ratio else 0)
    epb = batch.block_tokens // ratio if ratio else 1
    pool_flat = pool.reshape(-1, pool.shape[-1]) if pool is not None else new_kv
    if mode == 2 and max_pos is None:
        max_pos = int(batch.positions.max())  # a host sync: pass max_pos under CUDA graphs
    return _launch(q, sink.float().contiguous(), scale, new_kv, ring, pool_flat, pool_flat.stride(0),
                   batch.block_tables, None if idx is None else idx.to(torch.int32), batch.token_req, batch.positions,
                   batch.slots, batch.seg_start, batch.seg_row0, window=window, mode=mode, ratio=ratio, epb=epb,
                   paged=True, fp8=fp8, head_dim=head_dim, rope_dim=rope_dim, max_pos=max_pos or 0)
