"""The differentiable training forward of a DeepSeek-V4 model: whole sequences [B, S] from position
0, over the same modules (and so the same parameters) the inference model serves with.

The inference path (`Transformer.forward`) walks requests and caches; this one computes the same
math on dense batched tensors with autograd:
- window attention in chunks of `window` queries against their own and the previous chunk;
- compressed entries pooled for the whole sequence at once (overlapping ratio 4, ratio 128);
- CSA: every visible entry in the DSA warm-up (`dense_indexer`), the indexer's top-k afterwards;
  HCA: every visible entry; one softmax with the sink over window + compressed logits;
- storage round trips (FP8 KV) always, FP4 of the indexer QK path and of the experts when asked,
  as straight-through estimators, so that what is trained is what is served;
- the indexer reads detached inputs and learns only from its KL to the main attention (the DSA
  recipe), on `kl_queries` sampled query positions per sequence;
- with `mtp_chain`, the last MTP block once more on its own output, as the engine chains it.
`tests/test_train_forward.py` checks the logits against the inference model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from hybridkv.config import KV_FP8_BLOCK
from hybridkv.errors import TrainingError
from hybridkv.model.attention import Attention
from hybridkv.model.compressor import Compressor
from hybridkv.model.moe import MoE
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.mhc import reference as mhc_ref
from hybridkv.train.qat import fp4_round_trip_ste, fp4_weight_fake, fp8_act_fake, fp8_round_trip_ste
from hybridkv.ops.rope import apply_rope, rope_freqs

@dataclass
class TrainOptions:
    dense_indexer: bool = True   # DSA warm-up: CSA layers attend to every visible entry
    qat_experts: bool = False    # FP4 fake quantisation of the routed experts (switched on late)
    qat_indexer: bool = False    # FP4 round trip of the indexer QK path, as served
    kl_queries: int = 256        # query positions per sequence the indexer KL is computed on
    reuse_layers_train_indexer: bool = False  # V4.1 Reuse layers' attention in the KL of the top-k they read
    query_tile: int = 2048       # queries per tile when the indexer selects top-k (bounds memory)
    capture_indexer: bool = False  # keep each V4 CSA layer's indexer inputs in `Aux.captured` (labels)
    # the last MTP block once more on its own output stream, as the engine chains it for a second draft
    # (`mtp_chain_pass`): 0 or 1
    mtp_chain: int = 0
    frozen_trunk: bool = False   # the main layers run without gradients (a recipe that trains only the MTP)


@dataclass
class Aux:
    """What a forward leaves besides the stream: indexer KL terms and expert loads, by layer."""
    indexer_kl: dict[int, torch.Tensor] = field(default_factory=dict)
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)
    # dense forwards only: recall of the indexer's top-k against the main attention's top-k (its
    # head-summed probabilities) at the KL query positions that see more than k entries
    indexer_recall: dict[int, float] = field(default_factory=dict)
    # `capture_indexer` only, per V4 CSA layer (detached): the attention input `x` [B·S, dim], the
    # indexer's queries `q` [B·S, H, d] and head weights `w` [B·S, H], its keys `keys` [B, n, d]
    captured: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class _Ctx:
    """Per-forward constants: batch shape, positions and rotations by rope kind."""

    def __init__(self, batch: int, seq: int, device, opts: TrainOptions, aux: Aux, gen: torch.Generator | None):
        self.b, self.s, self.opts, self.aux, self.gen = batch, seq, opts, aux, gen
        self.positions = torch.arange(seq, device=device)
        self._freqs: dict = {}
        # V4.1 hand-offs within one forward: each Full layer's (global KV, indexer keys), the last
        # index source's (layer, indexer queries, head weights) and top-k, and the candidate pool
        # (one bool [S, n] per sequence)
        self.v41_entries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.v41_indexer: tuple[Attention, torch.Tensor, torch.Tensor] | None = None
        self.v41_topk: torch.Tensor | None = None
        self.v41_pool: list[torch.Tensor] | None = None
        # the chained MTP pass: each window layer's rows from the pass before (by layer id), and the
        # rows the layer now running reads at the positions before its own
        self.window_rows: dict[int, torch.Tensor] | None = None
        self.chain_rows: dict[int, torch.Tensor] | None = None

    def freqs(self, attn: Attention) -> torch.Tensor:
        """[B·S, rope/2] rotations of the flat batch for this layer's rope kind."""
        key = (attn.rope_key, attn.inv_freq.data_ptr())
        if key not in self._freqs:
            self._freqs[key] = rope_freqs(self.positions, attn.inv_freq).repeat(self.b, 1)
        return self._freqs[key]


# ----- compressed entries -----

def _whole_blocks(t: torch.Tensor, b: int, s: int, r: int) -> torch.Tensor:
    """[B·S, d] -> [B, S // r, r, d] in float32: each sequence's complete blocks of `r` tokens
    (none for a sequence shorter than `r`, hence the explicit last dim)."""
    t = t.float().view(b, s, -1)
    return t[:, : (s // r) * r].reshape(b, s // r, r, t.shape[-1])


def compress_sequence(comp: Compressor, x: torch.Tensor, ctx: _Ctx, inv_freq: torch.Tensor, kind: str) -> torch.Tensor:
    """All complete blocks of each sequence -> finished entries [B, S // ratio, d] ("main": FP8 nope
    round trip; "index": Hadamard then FP4 round trip when training with QAT)."""
    b, s, r = ctx.b, ctx.s, comp.ratio
    n = s // r
    kv, score = comp.project(x, ctx.positions.repeat(b))
    kv, score = _whole_blocks(kv, b, s, r), _whole_blocks(score, b, s, r)
    if comp.overlap:  # block j pools block j-1 through the first half of the channels
        d = kv.shape[-1] // 2
        prev_kv = torch.cat([kv.new_zeros(b, 1, r, d), kv[:, :-1, :, :d]], 1)
        prev_sc = torch.cat([score.new_full((b, 1, r, d), float("-inf")), score[:, :-1, :, :d]], 1)
        kv = torch.cat([prev_kv, kv[..., d:]], 2)
        score = torch.cat([prev_sc, score[..., d:]], 2)
    pooled = (kv * score.softmax(dim=2)).sum(2)                               # [B, n, d]
    x32 = pooled.to(comp.out_dtype).float()
    c = (comp.norm.weight * (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + comp.norm.eps)))
    c = c.to(comp.out_dtype)
    freqs = rope_freqs(torch.arange(n, device=x.device) * r, inv_freq)
    c = apply_rope(c.transpose(0, 1), freqs).transpose(0, 1)
    if kind == "index":
        h = hadamard_transform(c)
        return fp4_round_trip_ste(h, 32) if ctx.opts.qat_indexer else h
    rd = 2 * freqs.shape[-1]
    nope = c[..., :-rd]
    return torch.cat([fp8_round_trip_ste(nope, KV_FP8_BLOCK, comp.kv_pow2), c[..., -rd:]], -1)


def latent_sequence(comp: Compressor, x: torch.Tensor, ctx: "_Ctx") -> torch.Tensor:
    """V4.1 Full layers: the pre-RoPE latent of every complete block [B, S // ratio, d] (ratio 1:
    `norm(wkv(x))` per token; ratio r: per-channel softmax pooling of r tokens, then the norm)."""
    b, s, r = ctx.b, ctx.s, comp.ratio
    kv, score = comp.project(x, ctx.positions.repeat(b))
    if score is None:
        return kv.view(b, s, -1)
    kv, score = _whole_blocks(kv, b, s, r), _whole_blocks(score, b, s, r)
    return comp.norm((kv * score.softmax(dim=2)).sum(2).to(comp.out_dtype))


def v41_source_entries(attn: Attention, x: torch.Tensor, ctx: "_Ctx") -> None:
    """A Full layer's global KV and indexer keys for the whole sequence, kept in ctx for the layers
    that share them: RoPE at each block's first position; FP4 (e4m3 scales per 16) / FP4 (ue8m0 per
    32) round trips as straight-through estimators."""
    from hybridkv.config import FP4_BLOCK, V41_GLOBAL_FP4_BLOCK
    latent = latent_sequence(attn.compressor, x, ctx)                        # [B, n, d]
    n = latent.shape[1]
    freqs = rope_freqs(torch.arange(n, device=x.device) * attn.ratio, attn.inv_freq)
    gkv = apply_rope(latent.transpose(0, 1), freqs).transpose(0, 1)
    gkv = fp4_round_trip_ste(gkv, V41_GLOBAL_FP4_BLOCK, "e4m3")
    ind = attn.indexer
    keys = apply_rope(ind.k_norm(ind.wk(latent.detach())).transpose(0, 1), freqs).transpose(0, 1)
    keys = fp4_round_trip_ste(keys, FP4_BLOCK)
    ctx.v41_entries[attn.layer_id] = (gkv.float(), keys)


def _select_v41(attn: Attention, iq, iw, keys: torch.Tensor, ctx: "_Ctx") -> torch.Tensor:
    """V4.1 top-k in position order [B, S, k] (−1 padded), through the candidate pool when this
    layer uses it; the candidate source publishes the pool in ctx (no grad)."""
    from hybridkv.ops.indexer_topk.reference import candidate_blocks, causal_topk, index_scores, mask_invisible
    ind = attn.indexer
    b, s, n = ctx.b, ctx.s, keys.shape[1]
    k = min(ind.topk, n)
    vis = torch.div(ctx.positions + 1, attn.ratio, rounding_mode="floor")
    out = torch.empty(b, s, k, dtype=torch.long, device=keys.device)
    with torch.no_grad():
        iq, iw = iq.view(b, s, *iq.shape[1:]), iw.view(b, s, -1)
        pools = ctx.v41_pool if ind.uses_candidates else None
        publish = [] if ind.is_candidate_source else None
        for i in range(b):
            rows = []
            for t0 in range(0, s, ctx.opts.query_tile):
                t1 = min(s, t0 + ctx.opts.query_tile)
                sc = mask_invisible(index_scores(iq[i, t0:t1], iw[i, t0:t1], keys[i]), vis[t0:t1])
                if publish is not None:
                    rows.append(candidate_blocks(sc, vis[t0:t1], ind.pool_blocks, ind.pool_block_size))
                elif pools is not None:
                    sc = sc.masked_fill(~pools[i][t0:t1], float("-inf"))
                out[i, t0:t1] = causal_topk(sc, vis[t0:t1], k, by_position=True)
            if publish is not None:
                publish.append(torch.cat(rows))
        if publish is not None:
            ctx.v41_pool = publish
    return out


# ----- attention -----

def _window_logits(q: torch.Tensor, kv: torch.Tensor, window: int, scale: float):
    """q [B, S, H, D], kv [B, S, D] -> (logits [B, S, H, 2W] over each query's chunk pair, keys
    [B, C, 2W, D]); logits outside [t − W + 1, t] are −inf."""
    b, s, h, d = q.shape
    pad = -s % window
    c = (s + pad) // window
    kvp = F.pad(kv, (0, 0, window, pad))
    keys = torch.cat([kvp[:, : c * window].view(b, c, window, d), kvp[:, window:].view(b, c, window, d)], 2)
    qc = F.pad(q, (0, 0, 0, 0, 0, pad)).view(b, c, window, h, d)
    logits = torch.einsum("bcqhd,bckd->bcqhk", qc.float(), keys.float()) * scale
    qi = torch.arange(window, device=q.device).view(window, 1)
    kk = torch.arange(2 * window, device=q.device).view(1, 2 * window)
    ok = (kk > qi) & (kk <= qi + window)                                      # [W, 2W]
    ok = ok.unsqueeze(0).expand(c, -1, -1).clone()
    ok[0, :, :window] = False                                                # before position 0
    logits = logits.masked_fill(~ok.view(1, c, window, 1, 2 * window), float("-inf"))
    return logits.view(b, c * window, h, 2 * window)[:, :s], keys


def _chained_window_logits(q: torch.Tensor, earlier: torch.Tensor, own: torch.Tensor, window: int, scale: float):
    """`_window_logits` where each query's own position holds its own row `own` [B, S, D] and the
    positions before it the rows `earlier` [B, S, D] of another pass. Returns (logits, keys of
    `earlier`, a function of the window probabilities giving what the own rows add to the output
    beyond the `earlier` rows at those positions)."""
    b, s, h, d = q.shape
    logits, keys = _window_logits(q, earlier, window, scale)
    diag = (torch.arange(s, device=q.device) % window + window).view(1, s, 1, 1).expand(b, s, h, 1)
    mine = torch.einsum("bshd,bsd->bsh", q.float(), own.float()).unsqueeze(-1) * scale
    logits = logits.scatter(-1, diag, mine)
    delta = (own.float() - earlier.float()).unsqueeze(2)                    # [B, S, 1, D]

    def own_output(p: torch.Tensor) -> torch.Tensor:
        return p.gather(-1, diag) * delta

    return logits, keys, own_output


def _window_output(p: torch.Tensor, keys: torch.Tensor, window: int) -> torch.Tensor:
    b, s, h, _ = p.shape
    c = keys.shape[1]
    p = F.pad(p, (0, 0, 0, 0, 0, c * window - s)).view(b, c, window, h, 2 * window)
    return torch.einsum("bcqhk,bckd->bcqhd", p, keys.float()).reshape(b, c * window, h, -1)[:, :s]


def _select(attn: Attention, iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """Indexer top-k of each query among its visible entries: [B, S, k], −1 padded (no grad)."""
    from hybridkv.ops.indexer_topk.reference import causal_topk, index_scores
    b, s = ctx.b, ctx.s
    n = keys.shape[1]
    k = min(attn.indexer.topk, n)
    vis = (ctx.positions + 1) // attn.ratio
    out = torch.empty(b, s, k, dtype=torch.long, device=keys.device)
    with torch.no_grad():
        iq, iw = iq.view(b, s, *iq.shape[1:]), iw.view(b, s, -1)
        for i in range(b):
            for t0 in range(0, s, ctx.opts.query_tile):
                t1 = min(s, t0 + ctx.opts.query_tile)
                scores = index_scores(iq[i, t0:t1], iw[i, t0:t1], keys[i])
                out[i, t0:t1] = causal_topk(scores, vis[t0:t1], k)
    return out


def _indexer_kl(attn: Attention, iq, iw, keys, main_p: torch.Tensor, sel: torch.Tensor | None, ctx: _Ctx,
                layer_id: int | None = None):
    """KL(head-summed main attention over compressed entries ‖ softmax of the indexer's scores) at
    `kl_queries` random query positions that see at least two entries, over all visible entries
    (dense warm-up) or the selected ones (`sel`). main_p [B, S, H, n]: the main attention's
    probabilities of every entry (0 where not attended), of `attn`'s layer or of the V4.1 Reuse
    layer `layer_id` that reads `attn`'s top-k."""
    b, s = ctx.b, ctx.s
    vis = (ctx.positions + 1) // attn.ratio
    cand = torch.nonzero(vis >= 2).flatten()
    if cand.numel() == 0:
        return None
    pick = cand[torch.randint(cand.numel(), (min(ctx.opts.kl_queries, cand.numel()),), device=cand.device,
                              generator=ctx.gen)]
    q = iq.view(b, s, *iq.shape[1:])[:, pick].float()                        # [B, P, Hi, di]
    w = iw.view(b, s, -1)[:, pick].float()                                   # [B, P, Hi]
    target = main_p[:, pick].detach().sum(2)                                 # [B, P, n]
    if sel is not None:                                                      # the selected entries' share
        target = torch.gather(target, 2, sel[:, pick].clamp(min=0))          # [B, P, k]
    if sel is None:
        scores = (torch.einsum("bphd,bnd->bphn", q, keys.float()).relu() * w.unsqueeze(-1)).sum(2)
        cols = torch.arange(keys.shape[1], device=keys.device)
        valid = cols.view(1, 1, -1) < vis[pick].view(1, -1, 1)
    else:
        idx = sel[:, pick]                                                   # [B, P, k]
        rows = torch.stack([keys[i][idx[i].clamp(min=0)] for i in range(b)])   # [B, P, k, di]
        scores = (torch.einsum("bphd,bpkd->bphk", q, rows.float()).relu() * w.unsqueeze(-1)).sum(2)
        valid = idx >= 0
    target = target.masked_fill(~valid, 0)
    if sel is None:
        _recall(attn, target, scores.detach(), vis[pick], ctx, attn.layer_id if layer_id is None else layer_id)
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-12)
    logp = scores.masked_fill(~valid, float("-inf")).log_softmax(-1)
    kl = torch.where(target > 0, target * (target.clamp(min=1e-12).log() - logp), torch.zeros_like(target))
    return kl.sum(-1).mean()


@torch.no_grad()
def _recall(attn: Attention, target: torch.Tensor, scores: torch.Tensor, vis: torch.Tensor, ctx: _Ctx,
            layer_id: int) -> None:
    k = attn.indexer.topk
    rows = vis > k
    if not rows.any():
        return
    t, sc = target[:, rows], scores[:, rows]
    cols = torch.arange(sc.shape[-1], device=sc.device)
    sc = sc.masked_fill(cols.view(1, 1, -1) >= vis[rows].view(1, -1, 1), float("-inf"))
    main_top = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, t.topk(k, dim=-1).indices, True)
    idx_top = torch.zeros_like(t, dtype=torch.bool).scatter_(-1, sc.topk(k, dim=-1).indices, True)
    ctx.aux.indexer_recall[layer_id] = float((main_top & idx_top).sum() / main_top.sum())


def attention_train(attn: Attention, x: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """x [B·S, dim] (after the attention norm) -> [B·S, dim]."""
    b, s = ctx.b, ctx.s
    h, d, rd = attn.n_heads, attn.head_dim, attn.rope_dim
    freqs = ctx.freqs(attn)
    qr = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(qr).unflatten(-1, (h, d)).float()
    if not attn.v41:  # V4 RMS-normalises each query head
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + attn.eps)
    q = apply_rope(q, freqs)
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), freqs)
    if attn.v41:
        from hybridkv.config import V41_WINDOW_FP8_BLOCK
        kv = fp8_round_trip_ste(kv, V41_WINDOW_FP8_BLOCK, attn.kv_pow2)
    else:
        nope = kv[..., :-rd]
        kv = torch.cat([fp8_round_trip_ste(nope, KV_FP8_BLOCK, attn.kv_pow2), kv[..., -rd:]], -1)

    qb = q.view(b, s, h, d)
    if ctx.window_rows is not None:
        ctx.window_rows[attn.layer_id] = kv
    earlier = None if ctx.chain_rows is None else ctx.chain_rows[attn.layer_id]
    if earlier is None:
        logits_w, keys_w = _window_logits(qb, kv.view(b, s, d), attn.window, attn.scale)
    else:
        logits_w, keys_w, own_w = _chained_window_logits(qb, earlier.view(b, s, d), kv.view(b, s, d), attn.window,
                                                         attn.scale)
    parts = [logits_w]
    entries = sel = None
    if attn.ratio and attn.v41:
        if attn.mode == "full":
            v41_source_entries(attn, x, ctx)
        entries, ikeys = ctx.v41_entries[attn.kv_source]
        n = entries.shape[1]
        vis = (ctx.positions + 1) // attn.ratio
        if attn.indexer is not None:
            ind = attn.indexer
            from hybridkv.config import FP4_BLOCK
            iq = apply_rope(ind.wq_b(qr.detach()).unflatten(-1, (ind.n_heads, ind.head_dim)), freqs)
            if ctx.opts.qat_indexer:
                iq = fp4_round_trip_ste(iq, FP4_BLOCK)
            iw = ind.head_weights(x.detach())
            ctx.v41_indexer = (attn, iq, iw)
            if not ctx.opts.dense_indexer and n:
                ctx.v41_topk = _select_v41(attn, iq, iw, ikeys.detach(), ctx)
        if not ctx.opts.dense_indexer and n:
            sel = ctx.v41_topk
    elif attn.ratio:
        entries = compress_sequence(attn.compressor, x, ctx, attn.inv_freq, "main").float()   # [B, n, D]
        n = entries.shape[1]
        vis = (ctx.positions + 1) // attn.ratio
        if attn.indexer is not None:
            ind = attn.indexer
            xd, qrd = x.detach(), qr.detach()
            iq = hadamard_transform(apply_rope(ind.wq_b(qrd).unflatten(-1, (ind.n_heads, ind.head_dim)), freqs))
            if ctx.opts.qat_indexer:
                iq = fp4_round_trip_ste(iq, 32)
            iw = ind.head_weights(xd)
            ikeys = compress_sequence(ind.compressor, xd, ctx, attn.inv_freq, "index")
            if ctx.opts.capture_indexer:
                ctx.aux.captured[attn.layer_id] = dict(x=xd, q=iq.detach(), w=iw.detach(), keys=ikeys.detach())
            if not ctx.opts.dense_indexer and n > ind.topk:
                sel = _select(attn, iq, iw, ikeys.detach(), ctx)
    if attn.ratio:
        # dense logits over every entry, masked to the visible ones (and to the top-k when the indexer
        # selects): the same softmax as gathering the selected rows, but all matmuls, whose backward
        # avoids the slow scatter of an index gather
        cols = torch.arange(n, device=x.device)
        hidden = (cols.view(1, -1) >= vis.view(-1, 1)).view(1, s, n)
        if sel is not None:
            chosen = torch.zeros(b, s, n + 1, dtype=torch.bool, device=x.device)
            chosen.scatter_(2, torch.where(sel >= 0, sel, n), True)
            hidden = hidden | ~chosen[..., :n]
        logits_c = torch.einsum("bshd,bnd->bshn", qb, entries) * attn.scale
        logits_c = logits_c.masked_fill(hidden.unsqueeze(2), float("-inf"))
        parts.append(logits_c)
    sink = attn.attn_sink.float().view(1, 1, h, 1).expand(b, s, h, 1)
    p = torch.cat([*parts, sink], -1).softmax(-1)
    o = _window_output(p[..., : 2 * attn.window], keys_w, attn.window)
    if earlier is not None:
        o = o + own_w(p[..., : 2 * attn.window])
    if attn.ratio:
        p_c = p[..., 2 * attn.window: -1]
        o = o + torch.einsum("bshn,bnd->bshd", p_c, entries)
        kl = None
        if attn.indexer is not None and n:
            kl = _indexer_kl(attn, iq, iw, ikeys, p_c, sel, ctx)
        elif attn.v41 and n and ctx.v41_indexer is not None and ctx.opts.reuse_layers_train_indexer:
            # a Reuse layer attends within the top-k of the last index source: its attention is
            # part of what that indexer must learn to select (the shared top-k serves every layer)
            source, iq, iw = ctx.v41_indexer
            kl = _indexer_kl(source, iq, iw, ikeys, p_c, sel, ctx, layer_id=attn.layer_id)
        if kl is not None:
            ctx.aux.indexer_kl[attn.layer_id] = kl
    o = apply_rope(o.reshape(b * s, h, d).to(x.dtype), freqs, inverse=True)
    o = o.reshape(b * s, attn.groups, -1)
    wo_a = attn.wo_a.dense_weight().view(attn.groups, attn.o_rank, -1)
    o = torch.einsum("tgd,grd->tgr", o, wo_a.to(o.dtype))
    return attn.wo_b(o.flatten(1))


# ----- MoE and blocks -----

def _stacked(moe: MoE, name: str, qat: bool, dtype: torch.dtype) -> torch.Tensor:
    """The routed experts' `name` weights as one [E, out, in] tensor (FP4 fake-quantised under QAT)."""
    w = torch.stack([getattr(e, name).weight for e in moe.experts])
    if qat:
        w = fp4_weight_fake(w)
    return w.to(dtype)


def moe_train(moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, ctx: _Ctx, layer_id: int) -> torch.Tensor:
    """`MoE.forward` computed densely: every expert on every token, combined with the routing weights
    (zero for experts not selected). The same sum as the sparse dispatch, without per-expert host
    syncs; the experts are small enough that the extra FLOPs are cheaper than the syncs."""
    weights, ids = moe.gate(x, input_ids)
    e_count = moe.n_experts
    counts = torch.bincount(ids.flatten(), minlength=e_count)
    ctx.aux.expert_counts[layer_id] = counts.detach()
    dense_w = torch.zeros(x.shape[0], e_count, dtype=torch.float32, device=x.device).scatter_add(1, ids, weights)
    qat = ctx.opts.qat_experts
    first = moe.experts[0]
    cdt = x.dtype if x.dtype != torch.float32 or not torch.is_autocast_enabled() else torch.bfloat16
    xin = x
    if qat:
        xin = fp8_act_fake(x, first.w1.act_block)
    w1, w3, w2 = (_stacked(moe, n, qat, cdt) for n in ("w1", "w3", "w2"))
    gate = torch.einsum("td,efd->tef", xin.to(cdt), w1).float()
    up = torch.einsum("td,efd->tef", xin.to(cdt), w3).float()
    if first.limit > 0:
        up = up.clamp(-first.limit, first.limit)
        gate = gate.clamp(max=first.limit)
    hid = (F.silu(gate) * up * dense_w.unsqueeze(-1)).to(x.dtype)             # [T, E, inter]
    if qat:
        hid = fp8_act_fake(hid, first.w2.act_block)
    y = torch.einsum("tef,edf->td", hid.to(cdt), w2).float()
    y = y + moe.shared_experts(x).float()
    return y.to(x.dtype)


def block_train(block, h: torch.Tensor, input_ids: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """`Block.forward` on the flat batch h [B·S, hc, dim] (reference mHC, which has autograd)."""
    def site(h, fn, scale, base):
        return mhc_ref.mhc_pre(h, F.linear(h.flatten(1).float(), fn), scale, base, block.hc_iters, block.hc_eps,
                               block.norm_eps)

    y, post, comb = site(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base)
    h = mhc_ref.mhc_post(attention_train(block.attn, block.attn_norm(y), ctx), h, post, comb)
    y, post, comb = site(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base)
    return mhc_ref.mhc_post(moe_train(block.ffn, block.ffn_norm(y), input_ids, ctx, block.layer_id), h, post, comb)


def block_train_single_pass(block, h: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor, ctx: _Ctx):
    """`Block.forward_single_pass` (V4.1): (h [B·S, hc, dim], the previous sub-block's pre mix) ->
    (h', the FFN's pre mix)."""
    from hybridkv.model.mhc import hc_collapse, hc_mixes
    args = (block.hc_iters, block.hc_eps, block.norm_eps)
    attn_pre, post, comb = hc_mixes(h, block.hc_attn_fn, block.hc_attn_scale, block.hc_attn_base, *args)
    h = mhc_ref.mhc_post(attention_train(block.attn, block.attn_norm(hc_collapse(h, pre)), ctx), h, post, comb)
    ffn_pre, post, comb = hc_mixes(h, block.hc_ffn_fn, block.hc_ffn_scale, block.hc_ffn_base, *args)
    y = moe_train(block.ffn, block.ffn_norm(hc_collapse(h, attn_pre)), input_ids, ctx, block.layer_id)
    return mhc_ref.mhc_post(y, h, post, comb), ffn_pre


@dataclass
class TrainOutput:
    stream: torch.Tensor              # what model.logits reads: [B·S, hc, dim] (V4), [B·S, dim] (V4.1)
    mtp_streams: list[torch.Tensor]   # per MTP depth, [B·S, hc, dim] (row t predicts token t + 2 + depth)
    aux: Aux


def train_forward(model, ids: torch.Tensor, opts: TrainOptions | None = None,
                  gen: torch.Generator | None = None) -> TrainOutput:
    """ids [B, S] (each row a sequence from position 0) -> streams for the LM and MTP heads (V4.1:
    the collapsed hidden state, and no MTP)."""
    opts = opts or TrainOptions()
    b, s = ids.shape
    aux = Aux()
    ctx = _Ctx(b, s, ids.device, opts, aux, gen)
    flat = ids.reshape(-1)
    h = model.embed(flat).unsqueeze(1).repeat(1, model.config.hc_mult, 1)
    if model.config.family == "v4.1":
        from hybridkv.model.mhc import hc_collapse, identity_pre
        pre = identity_pre(h)
        for layer in model.layers:
            h, pre = block_train_single_pass(layer, h, pre, flat, ctx)
        return TrainOutput(hc_collapse(h, pre), [], aux)
    with torch.set_grad_enabled(torch.is_grad_enabled() and not opts.frozen_trunk):
        for layer in model.layers:
            h = block_train(layer, h, flat, ctx)
    mtp = []
    cur, nxt = h, ids
    if opts.mtp_chain not in (0, 1):
        raise TrainingError(f"mtp_chain {opts.mtp_chain}: the training forward chains the last MTP block once (0 or 1)")
    if opts.mtp_chain and not model.mtp:
        raise TrainingError("mtp_chain: this model has no MTP block to chain")
    for depth, m in enumerate(model.mtp):
        nxt = F.pad(nxt[:, 1:], (0, 1))                                      # token t + 1 + depth at row t
        last = depth == len(model.mtp) - 1
        ctx.window_rows = {} if opts.mtp_chain and last else None
        cur = block_train(m, _mtp_input(model, m, cur, nxt), nxt.reshape(-1), ctx)
        mtp.append(cur)
    if opts.mtp_chain:
        mtp.append(mtp_chain_pass(model, cur, nxt, ctx))
    ctx.window_rows = ctx.chain_rows = None
    return TrainOutput(h, mtp, aux)


def _mtp_input(model, m, stream: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
    e = m.enorm(model.embed(next_ids.reshape(-1)))
    return m.e_proj(e).unsqueeze(1) + m.h_proj(m.hnorm(stream))


def mtp_chain_pass(model, stream: torch.Tensor, prev_ids: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
    """The last MTP block once more, as the engine chains it for draft 2 (`MTPDrafter._chain`).
    stream [B·S, hc, dim] is that block's output (row t predicts token t + 1 + depth, prev_ids [B, S]
    holding the token before it). The engine runs the chained row one position on, t + 1, where its
    window holds the block's own rows of the positions before (computed from the main model's
    streams) and its own row. Here every row t runs at t + 1 (rows shifted by one, row 0 a
    placeholder) with the window rows the block's last pass left (`ctx.window_rows`) at the earlier
    positions. Returns the output stream with row t at t again (the last row a placeholder)."""
    m = model.mtp[-1]
    if m.attn.ratio:
        raise TrainingError(f"mtp_chain: MTP layer {m.layer_id} compresses (ratio {m.attn.ratio}); only a window "
                            f"layer chains")
    b, s = prev_ids.shape
    nxt = F.pad(prev_ids[:, 1:], (0, 1))
    x = _mtp_input(model, m, stream, nxt)
    shifted = F.pad(x.view(b, s, *x.shape[1:])[:, :-1], (0, 0, 0, 0, 1, 0)).flatten(0, 1)
    shifted_ids = F.pad(nxt[:, :-1], (1, 0))
    ctx.chain_rows, ctx.window_rows = ctx.window_rows, None
    out = block_train(m, shifted, shifted_ids.reshape(-1), ctx)
    ctx.chain_rows = None
    return F.pad(out.view(b, s, *out.shape[1:])[:, 1:], (0, 0, 0, 0, 0, 1)).flatten(0, 1)
