"""Triton kernels of the grouped MoE's bookkeeping around its two GEMM launches.

- `route_kernel` (decode: at most `MAX_FUSED_PAIRS` (token, slot) pairs): one program sorts the
  pairs by expert, stably (rank = pairs of a smaller expert + earlier pairs of the same expert, as
  `reference.sort_by_expert` orders them), writes each sorted row's token and routing weight and
  each pair's sorted row, and builds the row-tile table of `reference.expert_tiles`: one launch
  instead of about twenty torch operations.
- `moe_combine_kernel`: each token's routed-expert rows added in expert order from zero in float32 (the
  per-expert loop's sums to the bit, as `reference.combine`), then an optional addend (the shared
  expert's output) and the cast to the result dtype, in one launch instead of a sort, a gather and a
  gather, a cast and an add per routing slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.quant.triton import _bf16_round

MAX_FUSED_PAIRS = 512


@triton.jit
def route_kernel(IDS, W, TOKEN, ROUTE, INV, TILE_E, TILE_S, TILE_T, P, K, E, MAX_TILES, BM,
                 EP: tl.constexpr, BLOCK: tl.constexpr, TB: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    ex = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    for p0 in range(0, P, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        ok = p < P
        e_p = tl.load(IDS + p, mask=ok, other=-1).to(tl.int32)
        counts += tl.sum((ex[:, None] == e_p[None, :]).to(tl.int32), 1)
        rank = tl.zeros([BLOCK], tl.int32)
        for q0 in range(0, P, BLOCK):
            q = q0 + tl.arange(0, BLOCK)
            e_q = tl.load(IDS + q, mask=q < P, other=2147483647).to(tl.int32)
            before = (e_q[None, :] < e_p[:, None]) | ((e_q[None, :] == e_p[:, None]) & (q[None, :] < p[:, None]))
            rank += tl.sum(before.to(tl.int32), 1)
        tl.store(INV + p, rank, mask=ok)
        tl.store(TOKEN + rank, (p // K).to(tl.int32), mask=ok)
        tl.store(ROUTE + rank, tl.load(W + p, mask=ok, other=0.0).to(tl.float32), mask=ok)
    offsets = tl.cumsum(counts, 0) - counts              # first sorted row of each expert
    tiles = (counts + BM - 1) // BM
    cum = tl.cumsum(tiles, 0)                            # tiles of experts 0..e
    for t0 in range(0, MAX_TILES, TB):
        t = t0 + tl.arange(0, TB)
        e_t = tl.sum((cum[None, :] <= t[:, None]).to(tl.int32), 1)       # searchsorted(cum, t, right)
        valid = e_t < E
        sel = ex[None, :] == e_t[:, None]
        off = tl.sum(tl.where(sel, offsets, 0), 1)
        first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 1)
        cnt = tl.sum(tl.where(sel, counts, 0), 1)
        start = off + (t - first_tile) * BM
        t_ok = t < MAX_TILES
        tl.store(TILE_E + t, tl.where(valid, e_t, -1), mask=t_ok)
        tl.store(TILE_S + t, tl.where(valid, start, 0), mask=t_ok)
        tl.store(TILE_T + t, tl.where(valid, off + cnt, 0), mask=t_ok)


def route(ids: torch.Tensor, weights: torch.Tensor, n_experts: int, block_m: int):
    """ids [T, k], routing weights [T, k] (P = T·k ≤ MAX_FUSED_PAIRS) -> (token int32 [P] and
    routing weight float32 [P] of each sorted row, sorted row int32 [P] of each pair, the tile table
    (expert, first row, end row) int32 of `reference.expert_tiles` for block_m)."""
    t, k = ids.shape
    p = t * k
    if p > MAX_FUSED_PAIRS:
        raise ValueError(f"fused routing: {p} pairs > {MAX_FUSED_PAIRS}")
    max_tiles = -(-p // block_m) + min(n_experts, p)
    dev = ids.device
    token = torch.empty(p, dtype=torch.int32, device=dev)
    route_w = torch.empty(p, dtype=torch.float32, device=dev)
    inv = torch.empty(p, dtype=torch.int32, device=dev)
    tiles = tuple(torch.empty(max_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    if p:
        route_kernel[(1,)](ids.reshape(-1).contiguous(), weights.reshape(-1).contiguous(), token, route_w, inv, *tiles,
                           p, k, n_experts, max_tiles, block_m, EP=triton.next_power_of_2(n_experts),
                           BLOCK=max(16, triton.next_power_of_2(min(p, 128))), TB=32, num_warps=4, **triton_args(ids))
    return token, route_w, inv, tiles


@triton.jit
def moe_combine_kernel(OUT, INV, IDS, PLUS, Y, D, K: tl.constexpr, KP: tl.constexpr, HAS_PLUS: tl.constexpr,
                   BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    s = tl.arange(0, KP)
    s_ok = s < K
    e = tl.load(IDS + t * K + s, mask=s_ok, other=0)
    row = tl.load(INV + t * K + s, mask=s_ok, other=0).to(tl.int64)
    e2 = tl.load(IDS + t * K + s, mask=s_ok, other=0)      # the same row, as the other operand
    # each slot's place in the token's expert order (stable: ties by slot)
    before = ((e2[None, :] < e[:, None]) | ((e2[None, :] == e[:, None]) & (s[None, :] < s[:, None]))) & s_ok[None, :]
    place = tl.sum(before.to(tl.int32), 1)
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        p = tl.sum(tl.where((place == j) & s_ok, row, 0), 0)
        acc += tl.load(OUT + p * D + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_PLUS:
        acc += tl.load(PLUS + t * D + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * D + c, acc.to(Y.dtype.element_ty), mask=ok)


def combine(out: torch.Tensor, inverse: torch.Tensor, ids: torch.Tensor, plus: torch.Tensor | None,
            result_dtype: torch.dtype) -> torch.Tensor:
    """out [P, D] sorted rows, inverse [P] the sorted row of each pair, ids [T, k] -> [T, D] of
    result_dtype: each token's rows added in the order of their experts in float32, plus `plus`
    [T, D] when given."""
    t, k = ids.shape
    d = out.shape[-1]
    y = torch.empty(t, d, dtype=result_dtype, device=out.device)
    if t == 0:
        return y
    block = min(1024, triton.next_power_of_2(d))
    moe_combine_kernel[(t, triton.cdiv(d, block))](out.contiguous(), inverse.contiguous(), ids.contiguous(),
                                               plus.contiguous() if plus is not None else out, y, d, K=k,
                                               KP=triton.next_power_of_2(k), HAS_PLUS=plus is not None, BLOCK=block,
                                               num_warps=4, **triton_args(out))
    return y


@triton.jit
def gate_select_kernel(SCORES, BIAS, TID2EID, INPUT_IDS, W, IDS, E, route_scale, temp, norm_eps, K: tl.constexpr,
                       KP: tl.constexpr, BLOCK_E: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
                       TEMP: tl.constexpr, PDL: tl.constexpr):
    """Token t: sqrt(softplus(logits / temp (TEMP))) of its E experts; the top K of (score + bias),
    or on hash layers the K experts of its token id; their scores, normalised to sum 1 (NORM: divided
    by their sum + norm_eps), times route_scale."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    x = tl.load(SCORES + t * E + e, mask=ok, other=0.0)
    if TEMP:
        x = tl.math.div_rn(x, temp)
    # softplus as torch computes it (threshold 20), log1p(y) as log(u)·y / (u − 1) with u = 1 + y
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    s = tl.sqrt(tl.where(x > 20.0, x, log1p))
    kk = tl.arange(0, KP)
    kok = kk < K
    if HASH:
        tok = tl.load(INPUT_IDS + t)
        ids = tl.load(TID2EID + tok * K + kk, mask=kok, other=-1).to(tl.int64)
        w = tl.sum(tl.where(e[None, :] == ids[:, None], s[None, :], 0.0), 1)
    else:
        sel = tl.where(ok, s + tl.load(BIAS + e, mask=ok, other=0.0), float("-inf"))
        ids = tl.zeros([KP], tl.int64)
        w = tl.zeros([KP], tl.float32)
        for j in tl.static_range(K):
            best = tl.max(sel, 0)
            pick = tl.min(tl.where(sel == best, e, BLOCK_E), 0)     # the lowest index among equals
            ids = tl.where(kk == j, pick.to(tl.int64), ids)
            w = tl.where(kk == j, tl.sum(tl.where(e == pick, s, 0.0), 0), w)
            sel = tl.where(e == pick, float("-inf"), sel)
    if NORM:
        w = tl.math.div_rn(w, tl.sum(w, 0) + norm_eps)
    tl.store(W + t * K + kk, w * route_scale, mask=kok)
    tl.store(IDS + t * K + kk, ids, mask=kok)


def gate_select(scores: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float, norm: bool,
                tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None, temp: float = 1.0,
                norm_eps: float = 0.0):
    """scores [T, E] float32 gate logits -> (weights [T, k] float32, expert ids [T, k] int64)."""
    t, e = scores.shape
    scores = scores.float().contiguous()
    w = torch.empty(t, topk, dtype=torch.float32, device=scores.device)
    ids = torch.empty(t, topk, dtype=torch.int64, device=scores.device)
    hashed = tid2eid is not None
    if t:
        gate_select_kernel[(t,)](scores, scores if bias is None else bias.float().contiguous(),
                                 tid2eid.contiguous() if hashed else scores,
                                 input_ids.contiguous() if hashed else scores, w, ids, e, float(route_scale),
                                 float(temp), float(norm_eps), K=topk, KP=triton.next_power_of_2(topk),
                                 BLOCK_E=triton.next_power_of_2(e), HASH=hashed, NORM=norm, TEMP=temp != 1.0,
                                 num_warps=4, **triton_args(scores))
    return w, ids


@triton.jit
def swiglu_kernel(G, U, WTS, Y, n, s_g, s_u, limit, CLAMP: tl.constexpr, HAS_W: tl.constexpr, OUT_BF16: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    g = tl.load(G + t * s_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + t * s_u + c, mask=ok, other=0.0).to(tl.float32)
    if CLAMP:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    h = g / (1.0 + tl.exp(-g)) * u
    if HAS_W:
        h = tl.load(WTS + t) * h
    if OUT_BF16:   # round to nearest by hand: the interpreter's own cast truncates
        h = _bf16_round(h)
    tl.store(Y + t * n + c, h.to(Y.dtype.element_ty), mask=ok)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    n = gate.shape[-1]
    g, u = gate.reshape(-1, n), up.reshape(-1, n)
    if g.stride(-1) != 1 or u.stride(-1) != 1:
        g, u = g.contiguous(), u.contiguous()
    y = torch.empty(g.shape, dtype=out_dtype, device=gate.device)
    if g.shape[0]:
        w = weights.reshape(-1).float().contiguous() if weights is not None else g
        block = min(1024, triton.next_power_of_2(n))
        swiglu_kernel[(g.shape[0], triton.cdiv(n, block))](g, u, w, y, n, g.stride(0), u.stride(0), float(limit),
                                                          CLAMP=limit > 0, HAS_W=weights is not None,
                                                          OUT_BF16=out_dtype == torch.bfloat16, BLOCK=block,
                                                          num_warps=4, **triton_args(g))
    return y.view(*gate.shape[:-1], n)
