"""Exact causal top-k of one token's scores from what the scoring kernels wrote: an order-preserving
uint32 key per visible entry and the largest key of every TILE_N consecutive entries.

Five steps over data that stays in L2:
1. τ₀, a lower bound of the k-th largest score: the k-th largest tile maximum, to its top
   8·TAU_LEVELS bits (radix levels of 8-bit histograms over the maxima); 0 with fewer than k tiles.
   k distinct entries reach τ₀ (the maxima themselves), so every selected entry does too.
2. The tiles whose maximum reaches τ₀, in entry order (typically ≈ k of them).
3. Their keys ≥ τ₀: the candidates, in entry order (typically ≈ 1.1·k).
4. Four radix levels over the candidates: the exact threshold τ and how many keys equal to τ to keep.
5. The keys > τ and the first of the τ-ties, in entry order, into all k output slots.

`select_kernel` runs them in one program per token. Rows of at most VPAD entries (decode up to
`RESIDENT_SELECT_MAX` visible entries, e.g. a CSA layer at 16K context) skip steps 1-3: the
program holds every key in registers and runs steps 4-5 on them (`_select_resident`: four
histograms and one pass, no candidate copy through memory). With many tiles, steps 2-3 are the long serial
part of that program (a pass over every tile that reaches τ₀), so `gather_candidates_kernel` splits
them over G programs per token, each over a contiguous range of tiles writing its candidates to its
own region, and `select_final_kernel` (one program per token) joins the regions in entry order and
runs steps 4-5. Both give the same output: the selection is exact and ties go by entry order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from hybridkv.ops.pdl_device import wait_then_release


@triton.jit
def _digit_hist(PTR, n, prefix, LEVEL: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram of digit LEVEL (8 bits, from the top) of the keys PTR[0:n] whose higher digits equal `prefix`."""
    hist = tl.zeros([256], tl.int32)
    for i0 in range(0, n, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        m = i < n
        key = tl.load(PTR + i, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        if LEVEL > 0:
            m = m & ((key >> (32 - 8 * LEVEL)) == prefix)
        hist += tl.histogram(((key >> (24 - 8 * LEVEL)) & 255).to(tl.int32), 256, mask=m)
    return hist


@triton.jit
def _pick(hist, krem):
    """The bin holding the krem-th largest key and how many of its keys are still wanted."""
    b = tl.arange(0, 256)
    at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
    bsel = tl.max(tl.where(at_or_above >= krem, b, -1), 0)
    return bsel, krem - tl.sum(tl.where(b > bsel, hist, 0), 0)


@triton.jit
def _tau0(tmax, nt, K, TAU_LEVELS: tl.constexpr, BLOCK: tl.constexpr):
    """Step 1: τ₀ ≤ the K-th largest of the nt tile maxima (its top 8·TAU_LEVELS bits); 0 with fewer
    than K tiles."""
    tau0 = tl.zeros([], tl.uint32)
    if nt >= K:
        krem = K
        for lvl in tl.static_range(TAU_LEVELS):
            bsel, krem = _pick(_digit_hist(tmax, nt, tau0, lvl, BLOCK), krem)
            tau0 = (tau0 << 8) | bsel.to(tl.uint32)
        tau0 = tau0 << (32 - 8 * TAU_LEVELS)
    return tau0


@triton.jit
def _gather(keys, tmax, tlist, ck, ci, lo, hi, vis, tau0, TILE_N: tl.constexpr, BLOCK: tl.constexpr,
            TB: tl.constexpr):
    """Steps 2-3 over tiles [lo, hi): the keys ≥ τ₀ of the tiles whose maximum reaches τ₀, in entry
    order, to ck/ci (tile ids go to tlist + lo); returns their number."""
    ns = 0
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        mx = tl.load(tmax + i, mask=i < hi, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        sel = ((i < hi) & (mx >= tau0)).to(tl.int32)
        tl.store(tlist + lo + ns + tl.cumsum(sel, 0) - sel, i, mask=sel != 0)
        ns += tl.sum(sel, 0)
    tl.debug_barrier()
    nc = 0
    ti = tl.arange(0, TB)
    tix = tl.load(tlist + lo + ti, mask=ti < ns, other=0, cache_modifier=".cg")
    for i0 in range(0, ns, TB):
        i = i0 + ti
        j = tix[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
        m = (i < ns)[:, None] & (j < vis)
        key = tl.load(keys + j, mask=m, other=0, cache_modifier=".cg")
        # the next block's tile ids: independent of this block, so their latency overlaps it
        tix = tl.load(tlist + lo + i + TB, mask=i + TB < ns, other=0, cache_modifier=".cg")
        sel = (m & (key.to(tl.uint32, bitcast=True) >= tau0)).to(tl.int32)
        key, j, sel = tl.reshape(key, [TB * TILE_N]), tl.reshape(j, [TB * TILE_N]), tl.reshape(sel, [TB * TILE_N])
        dst = nc + tl.cumsum(sel, 0) - sel
        tl.store(ck + dst, key, mask=sel != 0)
        tl.store(ci + dst, j, mask=sel != 0)
        nc += tl.sum(sel, 0)
    return nc


@triton.jit
def _finish(ck, ci, nc, out, K, CBLOCK: tl.constexpr):
    """Steps 4-5 over the nc candidates ck/ci (in entry order): the K selected entries to out."""
    # 4. exact radix select among the candidates: threshold τ, and krem ties at τ to keep
    prefix = tl.zeros([], tl.uint32)
    krem = K
    for lvl in tl.static_range(4):
        bsel, krem = _pick(_digit_hist(ck, nc, prefix, lvl, CBLOCK), krem)
        prefix = (prefix << 8) | bsel.to(tl.uint32)
    # 5. keys > τ and the first krem ties, in entry order
    base = 0
    eq_seen = 0
    for i0 in range(0, nc, CBLOCK):
        i = i0 + tl.arange(0, CBLOCK)
        m = i < nc
        key = tl.load(ck + i, mask=m, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
        idx = tl.load(ci + i, mask=m, other=0, cache_modifier=".cg")
        is_eq = (m & (key == prefix)).to(tl.int32)
        rank = eq_seen + tl.cumsum(is_eq, 0) - is_eq
        sel = ((m & (key > prefix)) | ((is_eq != 0) & (rank < krem))).to(tl.int32)
        tl.store(out + base + tl.cumsum(sel, 0) - sel, idx, mask=sel != 0)
        base += tl.sum(sel, 0)
        eq_seen += tl.sum(is_eq, 0)


@triton.jit
def _select_resident(keys, vis, out, K, VPAD: tl.constexpr):
    """Steps 4-5 over all vis (≤ VPAD) keys at once, held in registers: the exact threshold τ and
    the ties to keep by four 8-bit histograms, then the keys > τ and the first ties, in entry order."""
    i = tl.arange(0, VPAD)
    ok = i < vis
    key = tl.load(keys + i, mask=ok, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
    prefix = tl.zeros([], tl.uint32)
    krem = K
    for lvl in tl.static_range(4):
        m = ok
        if lvl > 0:
            m = m & ((key >> (32 - 8 * lvl)) == prefix)
        bsel, krem = _pick(tl.histogram(((key >> (24 - 8 * lvl)) & 255).to(tl.int32), 256, mask=m), krem)
        prefix = (prefix << 8) | bsel.to(tl.uint32)
    is_eq = (ok & (key == prefix)).to(tl.int32)
    rank = tl.cumsum(is_eq, 0) - is_eq
    sel = ((ok & (key > prefix)) | ((is_eq != 0) & (rank < krem))).to(tl.int32)
    tl.store(out + tl.cumsum(sel, 0) - sel, i, mask=sel != 0)


@triton.jit
def visible_entries(VIS, t, RATIO: tl.constexpr):
    """Visible entries of token t: VIS[t] itself, or with RATIO > 0 VIS holds positions and a token at
    position p sees (p + 1) // RATIO entries (no separate launch computes them)."""
    v = tl.load(VIS + t)
    if RATIO > 0:
        v = (v + 1) // RATIO
    return v


@triton.jit
def _token_output(VIS, OUT, s_out, K, RATIO: tl.constexpr, KPAD: tl.constexpr):
    """(token, its visible entries, its output row) of this program; a token that sees at most K
    entries gets them all here (ascending, −1 padded) and needs no selection."""
    t = tl.program_id(0)
    vis = visible_entries(VIS, t, RATIO)
    out = OUT + t.to(tl.int64) * s_out
    if vis <= K:
        j = tl.arange(0, KPAD)
        tl.store(out + j, tl.where(j < vis, j, -1), mask=j < K)
    return t, vis, out


@triton.jit
def select_kernel(KEYS, s_keys, TMAX, s_tmax, TLIST, CK, CI, s_cand, VIS, OUT, s_out, K, RATIO: tl.constexpr,
                  TILE_N: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr, CBLOCK: tl.constexpr,
                  TAU_LEVELS: tl.constexpr, KPAD: tl.constexpr, VPAD: tl.constexpr, PDL: tl.constexpr):
    """Exact top-K of token t's keys (steps in the module docstring) in one program; writes all K
    output slots. VPAD > 0: no row has more entries (`_select_resident`)."""
    wait_then_release(PDL)
    t, vis, out = _token_output(VIS, OUT, s_out, K, RATIO, KPAD)
    if VPAD > 0:
        if vis > K:
            _select_resident(KEYS + t.to(tl.int64) * s_keys, vis, out, K, VPAD)
    elif vis > K:
        tmax = TMAX + t.to(tl.int64) * s_tmax
        nt = (vis + TILE_N - 1) // TILE_N
        tau0 = _tau0(tmax, nt, K, TAU_LEVELS, BLOCK)
        ck = CK + t.to(tl.int64) * s_cand
        ci = CI + t.to(tl.int64) * s_cand
        nc = _gather(KEYS + t.to(tl.int64) * s_keys, tmax, TLIST + t.to(tl.int64) * s_tmax, ck, ci, 0, nt, vis,
                     tau0, TILE_N, BLOCK, TB)
        tl.debug_barrier()
        _finish(ck, ci, nc, out, K, CBLOCK)


@triton.jit
def gather_candidates_kernel(KEYS, s_keys, TMAX, s_tmax, TLIST, CK, CI, s_cand, CNT, VIS, K, RATIO: tl.constexpr,
                             G: tl.constexpr, TILE_N: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr,
                             TAU_LEVELS: tl.constexpr, PDL: tl.constexpr):
    """Steps 1-3 of token t over the g-th of G contiguous ranges of its tiles. Every program of a
    token computes the same τ₀; range g's candidates go to the candidate row from entry
    g·ceil(nt/G)·TILE_N on (no range has more candidates than entries), their number to CNT[t, g]."""
    wait_then_release(PDL)
    t = tl.program_id(0)
    g = tl.program_id(1)
    vis = visible_entries(VIS, t, RATIO)
    if vis > K:
        tmax = TMAX + t.to(tl.int64) * s_tmax
        nt = (vis + TILE_N - 1) // TILE_N
        tau0 = _tau0(tmax, nt, K, TAU_LEVELS, BLOCK)
        per = (nt + G - 1) // G
        lo = g * per
        off = t.to(tl.int64) * s_cand + lo * TILE_N
        nc = _gather(KEYS + t.to(tl.int64) * s_keys, tmax, TLIST + t.to(tl.int64) * s_tmax, CK + off, CI + off,
                     lo, tl.minimum(nt, lo + per), vis, tau0, TILE_N, BLOCK, TB)
        tl.store(CNT + t * G + g, nc)


@triton.jit
def select_final_kernel(CK, CI, s_cand, CK2, CI2, CNT, VIS, OUT, s_out, K, RATIO: tl.constexpr, G: tl.constexpr,
                        TILE_N: tl.constexpr,
                        CB: tl.constexpr, CBLOCK: tl.constexpr, KPAD: tl.constexpr, PDL: tl.constexpr):
    """Steps 4-5 of token t after `gather_candidates_kernel`: the G regions' candidates joined in
    entry order into CK2/CI2 (CB per region at a time), then the exact selection."""
    wait_then_release(PDL)
    t, vis, out = _token_output(VIS, OUT, s_out, K, RATIO, KPAD)
    if vis > K:
        nt = (vis + TILE_N - 1) // TILE_N
        per = (nt + G - 1) // G
        gi = tl.arange(0, G)
        cnt = tl.load(CNT + t * G + gi)
        before = tl.cumsum(cnt, 0) - cnt                       # candidates of the earlier regions
        src = t.to(tl.int64) * s_cand + (gi * per * TILE_N).to(tl.int64)
        dst = t.to(tl.int64) * s_cand + before.to(tl.int64)
        c = tl.arange(0, CB)
        for c0 in range(0, tl.max(cnt, 0), CB):
            m = (c0 + c)[None, :] < cnt[:, None]
            key = tl.load(CK + src[:, None] + (c0 + c)[None, :], mask=m, cache_modifier=".cg")
            idx = tl.load(CI + src[:, None] + (c0 + c)[None, :], mask=m, cache_modifier=".cg")
            tl.store(CK2 + dst[:, None] + (c0 + c)[None, :], key, mask=m)
            tl.store(CI2 + dst[:, None] + (c0 + c)[None, :], idx, mask=m)
        tl.debug_barrier()
        _finish(CK2 + t.to(tl.int64) * s_cand, CI2 + t.to(tl.int64) * s_cand, tl.sum(cnt, 0), out, K, CBLOCK)
