"""Exact causal top-k of one token's scores from what the scoring kernels wrote: an order-preserving
uint32 key per visible entry and the largest key of every TILE_N consecutive entries.

One program per token, in five steps over data that stays in L2:
1. τ₀, a lower bound of the k-th largest score: the k-th largest tile maximum, to its top
   8·TAU_LEVELS bits (radix levels of 8-bit histograms over the maxima); 0 with fewer than k tiles.
   k distinct entries reach τ₀ (the maxima themselves), so every selected entry does too.
2. The tiles whose maximum reaches τ₀, in entry order (typically ≈ k of them).
3. Their keys ≥ τ₀: the candidates, in entry order (typically ≈ 1.1·k).
4. Four radix levels over the candidates: the exact threshold τ and how many keys equal to τ to keep.
5. The keys > τ and the first of the τ-ties, in entry order, into all k output slots.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def select_kernel(KEYS, s_keys, TMAX, s_tmax, TLIST, CK, CI, s_cand, VIS, OUT, s_out, K,
                  TILE_N: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr, CBLOCK: tl.constexpr,
                  TAU_LEVELS: tl.constexpr, KPAD: tl.constexpr):
    """Exact top-K of token t's keys (steps in the module docstring); writes all K output slots."""
    t = tl.program_id(0)
    vis = tl.load(VIS + t)
    out = OUT + t.to(tl.int64) * s_out
    if vis <= K:
        j = tl.arange(0, KPAD)
        tl.store(out + j, tl.where(j < vis, j, -1), mask=j < K)
    else:
        keys = KEYS + t.to(tl.int64) * s_keys
        tmax = TMAX + t.to(tl.int64) * s_tmax
        tlist = TLIST + t.to(tl.int64) * s_tmax
        ck = CK + t.to(tl.int64) * s_cand
        ci = CI + t.to(tl.int64) * s_cand
        nt = (vis + TILE_N - 1) // TILE_N
        # 1. τ₀ ≤ the K-th largest tile maximum (its top 8·TAU_LEVELS bits); 0 (all) with fewer than K tiles
        tau0 = tl.zeros([], tl.uint32)
        if nt >= K:
            krem = K
            for lvl in tl.static_range(TAU_LEVELS):
                bsel, krem = _pick(_digit_hist(tmax, nt, tau0, lvl, BLOCK), krem)
                tau0 = (tau0 << 8) | bsel.to(tl.uint32)
            tau0 = tau0 << (32 - 8 * TAU_LEVELS)
        # 2. the tiles that can hold a selected entry, in entry order
        ns = 0
        for i0 in range(0, nt, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            mx = tl.load(tmax + i, mask=i < nt, other=0, cache_modifier=".cg").to(tl.uint32, bitcast=True)
            sel = ((i < nt) & (mx >= tau0)).to(tl.int32)
            tl.store(tlist + ns + tl.cumsum(sel, 0) - sel, i, mask=sel != 0)
            ns += tl.sum(sel, 0)
        tl.debug_barrier()
        # 3. their keys ≥ τ₀: the candidates, in entry order
        nc = 0
        ti = tl.arange(0, TB)
        tix = tl.load(tlist + ti, mask=ti < ns, other=0, cache_modifier=".cg")
        for i0 in range(0, ns, TB):
            i = i0 + ti
            j = tix[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
            m = (i < ns)[:, None] & (j < vis)
            key = tl.load(keys + j, mask=m, other=0, cache_modifier=".cg")
            # the next block's tile ids: independent of this block, so their latency overlaps it
            tix = tl.load(tlist + i + TB, mask=i + TB < ns, other=0, cache_modifier=".cg")
            sel = (m & (key.to(tl.uint32, bitcast=True) >= tau0)).to(tl.int32)
            key, j, sel = tl.reshape(key, [TB * TILE_N]), tl.reshape(j, [TB * TILE_N]), tl.reshape(sel, [TB * TILE_N])
            dst = nc + tl.cumsum(sel, 0) - sel
            tl.store(ck + dst, key, mask=sel != 0)
            tl.store(ci + dst, j, mask=sel != 0)
            nc += tl.sum(sel, 0)
        tl.debug_barrier()
        # 4. exact radix select among the candidates: threshold τ, and r ties at τ to keep
        prefix = tl.zeros([], tl.uint32)
        krem = K
        for lvl in tl.static_range(4):
            bsel, krem = _pick(_digit_hist(ck, nc, prefix, lvl, CBLOCK), krem)
            prefix = (prefix << 8) | bsel.to(tl.uint32)
        # 5. keys > τ and the first r ties, in entry order
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
