"""Hybrid attention layer: every layer attends over its 128-token sliding window; compressing
layers add compressed entries; pure-SWA layers (ratio 0) use the window only. One softmax with a
per-head sink runs over the union.

Which compressed entries, by family:
- V4: CSA layers (ratio 4) take the Lightning Indexer's top-k of their own entries, HCA layers
  (ratio 128) all visible entries of their own.
- V4.1: the CSA2 modes of `csa2.py` (Full / Reindex / Reuse), sharing one source layer's entries.
The families also differ in the query (V4 RMS-normalises each head) and in the window KV's storage
round trip (V4: FP8 nope dims in blocks of 64; V4.1: FP8 over all dims in blocks of 32).

Two ways to the same math. Where the request's store offers the paged kernels (V4 on CUDA: see
`PagedKVStore.kernel_formats`), the indexer scores the stored keys and attention reads the window
ring, the token's own row and the selected entries where they live, in their stored format. V4.1
decode groups over a store in the packed "v41" layout read the window and the selected global
entries that way too (`_attend_kernels_v41`): a selection that reads no candidate pool (and
publishes none) is V4's kernels' causal top-k in position order, one that does is made from the
kernels' scores by the indexer's own rules; the entries a Full layer's tokens complete are
compressed and stored by kernels. The reference path gathers and decodes the rows first (CPU,
V4.1 prefill, memory policies that keep entries off the device, the random-indexer ablation,
attention-mass capture).

On the reference path V4.1 batched decode (`_attend_decode_v41`) computes what a one-token segment
computes, to the bit, not within a tolerance: V4.1's FP4/FP8 round trips turn a float32 round-off
difference into a whole quantisation step wherever a value sits near a rounding midpoint. So a
decode row keeps its place in the flat batch (the engine and `ced.plan`), the window is listed as a
segment lists it, and a row attends over exactly its selection's width (min(top-k, visible
entries)).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import V41_WINDOW_FP8_BLOCK, ModelConfig
from hybridkv.distributed.group import SINGLE, Parallel
from hybridkv.distributed.sharding import attention_shard, record, record_linear
from hybridkv.model.compressor import Compressor
from hybridkv.model.csa2 import CrossLayerShare, LatentIndexer, global_kv
from hybridkv.model.indexer import Indexer
from hybridkv.model.linear import Linear, grouped_output, pair_storage, paired_forward, stack_storage, stacked_forward
from hybridkv.model.norm import RMSNorm
from hybridkv.model.state import DecodeGroup, DecodeKV, ForwardBatch, LayerKV, Segment
from hybridkv.ops.quant import fp8_round_trip
from hybridkv.ops.rope import apply_rope, apply_rope_, rope_freqs, yarn_inv_freq
from hybridkv.ops.rmsnorm import rms_norm_rope
from hybridkv.ops.compress import (compress_decode_latent, compress_decode_ok, compress_decode_paged,
                                   compress_paged)
from hybridkv.ops.indexer_topk import indexer_topk_paged, paged_scores
from hybridkv.ops.sparse_attn import sparse_attn, sparse_attn_paged
from hybridkv.ops.ranges import arange
from hybridkv.ops.window import round_trip_window_rows, write_window_float, write_window_fp8, write_window_v41
from hybridkv.ops.sparse_attn.reference import attention_probs

# the CrossLayerShare key of a forward's decode group (segments use their index)
DECODE_GROUP = -1


def layer_inv_freq(config: ModelConfig, ratio: int) -> torch.Tensor:
    """Compressing layers use compress_rope_theta with YaRN; pure-window layers plain rope_theta."""
    rs = config.rope_scaling
    if ratio and rs is not None:
        return yarn_inv_freq(config.qk_rope_head_dim, config.compress_rope_theta, rs.factor,
                             rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow)
    return yarn_inv_freq(config.qk_rope_head_dim, config.compress_rope_theta if ratio else config.rope_theta)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, dtype: torch.dtype,
                 parallel: Parallel = SINGLE):
        super().__init__()
        c = config
        self.layer_id, self.ratio = layer_id, c.layer_ratio(layer_id)
        self.v41 = c.family == "v4.1"
        self.mode = c.layer_kind(layer_id)
        # several ranks: this rank's heads (distributed/sharding.py); the KV head is every rank's
        self.parallel, self.shard = parallel, attention_shard(c, parallel, fmt)
        h0, h1 = self.shard.heads
        self.n_heads, self.head_dim, self.rope_dim = h1 - h0, c.head_dim, c.qk_rope_head_dim
        self.window, self.eps, self.o_rank = c.sliding_window, c.rms_norm_eps, c.o_lora_rank
        self.groups, self.all_groups = self.shard.groups, c.o_groups
        self.scale = self.head_dim**-0.5
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.wq_a = Linear(c.hidden_size, c.q_lora_rank, fmt, dtype, c.fp8_block)
        self.q_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fmt, dtype, c.fp8_block)
        self.wkv = Linear(c.hidden_size, self.head_dim, fmt, dtype, c.fp8_block)
        pair_storage(self.wq_a, self.wkv)    # one buffer: one packed GEMM reads both (FP8 only)
        self.kv_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        group_in = c.num_attention_heads * self.head_dim // c.o_groups     # wo_a's input per group
        wo_a_in = group_in if self.shard.by_group else self.n_heads * self.head_dim
        self.wo_a = Linear(wo_a_in, self.groups * self.o_rank, "float", dtype)
        out_in = (self.groups if self.shard.by_group else c.o_groups) * self.o_rank
        self.wo_b = Linear(out_in, c.hidden_size, fmt, dtype, c.fp8_block)
        if not (parallel.single or parallel.ordered):
            record(self, "attn_sink", (0, h0, h1))
            record_linear(self.wq_b, 0, h0 * self.head_dim, h1 * self.head_dim)
            if self.shard.by_group:
                g0 = h0 * self.head_dim // group_in
                record_linear(self.wo_a, 0, g0 * self.o_rank, (g0 + self.groups) * self.o_rank)
                record_linear(self.wo_b, 1, g0 * self.o_rank, (g0 + self.groups) * self.o_rank)
            else:   # rows of its group, columns of its heads within the group
                g, col = self.shard.group, h0 * self.head_dim - self.shard.group * group_in
                record(self.wo_a, "weight", (0, g * self.o_rank, (g + 1) * self.o_rank),
                       (1, col, col + self.n_heads * self.head_dim))
        self.compressor: Compressor | None = None
        self.indexer: Indexer | LatentIndexer | None = None
        if self.v41:
            self.kv_source = c.kv_source(layer_id)  # whose entries this layer attends over
            if self.mode == "full":
                self.compressor = Compressor(c, layer_id, self.head_dim, False, dtype)
            if self.mode in ("full", "reindex"):
                self.indexer = LatentIndexer(c, layer_id, fmt, dtype)
        else:
            if self.ratio:
                self.compressor = Compressor(c, layer_id, self.head_dim, False, dtype)
            if self.mode == "csa":
                self.indexer = Indexer(c, layer_id, fmt, dtype)
        self.stacked_projections: list[Linear] = []    # see stack_projections
        self.kv_pow2 = c.kv_pow2_scales
        self.indexer_topk = c.index_topk
        self.rope_key = ("compressed" if self.ratio else "window", c.qk_rope_head_dim)
        self.register_buffer("inv_freq", layer_inv_freq(c, self.ratio), persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, share: CrossLayerShare | None = None) -> torch.Tensor:
        """x [T, dim] (the whole flat batch) -> [T, dim]. `share` carries V4.1's cross-layer
        selections within this forward."""
        freqs = batch.rope(self.inv_freq, key=self.rope_key)
        q_a, kv_a = paired_forward(self.wq_a, self.wkv, x)
        qr = self.q_norm(q_a)
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        # q is the projection's fresh output: normalised (V4: each query head, without a weight) and
        # rotated where it lies
        q = rms_norm_rope(q, None, self.eps, freqs, in_place=True) if not self.v41 else apply_rope_(q, freqs)
        kv = rms_norm_rope(kv_a, self.kv_norm.weight, self.kv_norm.eps, freqs)
        if not self._window_rows_fused(batch):    # (the fused window stores round-trip the rows themselves)
            kv = (fp8_round_trip(kv, V41_WINDOW_FP8_BLOCK, self.kv_pow2) if self.v41 else
                  round_trip_window_rows(kv, self.rope_dim, self.kv_pow2))
        ced = batch.ced
        ahead = ced is not None and ced.source == self.layer_id   # CED: the compressor ran over every row
        fused = ()
        if batch.decode is not None and batch.decode.whole:
            fused = self._fused_compressors(batch.decode.kv)
        elif batch.waves and getattr(batch.waves[0].kv, "fuse_compressors", False):
            fused = self._fused_compressors(batch.waves[0].kv)   # every wave one kind of view (spec_graphs.py)
        rows = self._token_rows(x, qr, freqs, batch, compress=not ahead, fused=fused)

        # The output in the model's dtype: every path computes in float32, and its rows are rounded
        # once as they land (the kernels store them rounded), as the cast before the inverse
        # rotation did; a bf16 prefill chunk holds no float32 [T, H, D] copy. The output is written
        # over q, whose rows each segment, decode and wave reads only for its own output rows: one
        # [T, H, D] tensor for both (1 GiB at V4-Flash's width and 16K tokens; a prefill chunk beside
        # decode rows held three). CED's source layer keeps a separate output.
        whole = (not ahead and batch.decode is None and not batch.waves and len(batch.segments) == 1
                 and batch.segments[0].length == x.shape[0])
        over_q = not ahead and q.dtype == x.dtype and q.is_contiguous()
        if whole:
            o = self._attend_segment(batch.segments[0], 0, q, kv, batch.positions, rows, share, out_dtype=x.dtype,
                                     in_place=True)
        else:
            o = q if over_q else torch.empty(x.shape[0], self.n_heads, self.head_dim, dtype=x.dtype, device=x.device)
        if ahead:
            full = ced.full
            for s_full, seg_full in enumerate(full.segments):
                r = seg_full.rows
                self._append_global_kv(seg_full.start_pos, seg_full.kv.layer(self.layer_id), ced.comp["kv"][r],
                                       ced.comp["score"][r] if "score" in ced.comp else None)
                s = ced.sub_of[s_full]
                if s is not None:
                    seg = batch.segments[s]
                    r = seg.rows
                    o[r] = self._attend_segment(seg, s, q[r], kv[r], batch.positions[r],
                                                {k: v[r] for k, v in rows.items()}, share, out_dtype=x.dtype)
        elif not whole:
            for s, seg in enumerate(batch.segments):
                r = seg.rows
                out = self._attend_segment(seg, s, q[r], kv[r], batch.positions[r],
                                           {k: v[r] for k, v in rows.items()}, share, out_dtype=x.dtype,
                                           in_place=over_q)
                if out.data_ptr() != o[r].data_ptr():     # (the kernels wrote it there)
                    o[r] = out
        own = True                                # o is this forward's: rotated back in place below
        if batch.decode is not None:
            r = batch.decode.rows
            if batch.decode.whole and not ahead:      # a decode-only batch (CUDA graphs): no gathers
                o = (self._attend_decode_v41(batch.decode.kv, q, kv, rows, share) if self.v41
                     else self._attend_decode(batch.decode.kv, q, kv, rows, fused))
                own = o.dtype != x.dtype                  # (the cast below copies it)
            else:
                drows = {k: v[r] for k, v in rows.items()}
                if self.v41:
                    if ahead:   # CED: the source's compressor rows were computed over the whole forward
                        full_rows = ced.rows[r]
                        drows.update({f"comp_{k}": v[full_rows] for k, v in ced.comp.items()})
                    o[r] = self._attend_decode_v41(batch.decode.kv, q[r], kv[r], drows, share).to(o.dtype)
                else:
                    o[r] = self._attend_decode(batch.decode.kv, q[r], kv[r], drows).to(o.dtype)
        if batch.waves and self.v41:
            raise NotImplementedError("verify waves are V4's (V4.1 checkpoints have no MTP block)")
        if batch.waves:
            self._attend_waves(batch.waves, q, kv, rows, fused, o)
        # the per-token rows and q (o may be q itself) are dropped before the output projections
        # allocate theirs: at a 16K-token prefill chunk they hold about 1.5 GiB
        q_a = kv_a = qr = q = kv = rows = None
        o = (apply_rope_ if own else apply_rope)(o.to(x.dtype), freqs, inverse=True)
        o = grouped_output(o.reshape(x.shape[0], self.groups, -1), self.wo_a, self.groups)
        if self.parallel.single or self.parallel.ordered:
            return self.wo_b(o.flatten(1))
        if self.shard.by_group:    # wo_b split by its input: the ranks' outputs add up
            return self.parallel.all_reduce(self.wo_b(o.flatten(1)))
        # heads split within groups: each rank's partial of its group's wo_a output, summed first
        # (wo_b quantises its input, so the sum comes before it)
        full = o.new_zeros(x.shape[0], self.all_groups, self.o_rank)
        full[:, self.shard.group] = o[:, 0]
        return self.wo_b(self.parallel.all_reduce(full).flatten(1))

    def compress_rows(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """The compressor's per-token rows of a V4.1 source layer ("kv", and "score" unless ratio 1)
        from its attention input x [T, dim]: what CED runs over every row of a forward."""
        kv, score = self.compressor.project(x, positions)
        return {"kv": kv} if score is None else {"kv": kv, "score": score}

    def _token_rows(self, x, qr, freqs, batch: ForwardBatch, compress: bool = True,
                    fused: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
        """Per-token inputs of the compressed path, computed once for the flat batch; the score rows
        of the compressors in `fused` without their position bias (their decode kernel adds it)."""
        rows: dict[str, torch.Tensor] = {}
        proj = self.stacked_projections
        got = dict(zip(proj, stacked_forward(proj, x))) if proj and compress else {}
        pair = lambda c: (got[c.wkv], got.get(c.wgate)) if c.wkv in got else None  # noqa: E731
        if self.compressor is not None and compress:
            rows["comp_kv"], score = self.compressor.project(x, batch.positions, ape="kv" not in fused,
                                                             projected=pair(self.compressor))
            if score is not None:
                rows["comp_score"] = score
            elif self.v41:      # V4.1 ratio 1: each token is its entry, rotated at its own position
                rows["comp_freqs"] = freqs
        if self.indexer is not None:
            rows["idx_q"] = self.indexer.queries(qr, freqs)
            if not self.v41:
                rows["idx_w"] = self.indexer.head_weights(x, got.get(self.indexer.weights_proj))
                rows["idx_kv"], rows["idx_score"] = self.indexer.compressor.project(
                    x, batch.positions, ape="index" not in fused, projected=pair(self.indexer.compressor))
            else:
                rows["idx_w"] = self.indexer.head_weights(x, got.get(self.indexer.weights_proj))
        return rows

    def token_projections(self) -> list[Linear]:
        """The float linears that read the attention input of every token, in their stacked order:
        the compressor's kv and gate, then (V4's CSA) the indexer's compressor's kv and gate, then the
        indexer's head weights. V4.1: a Full layer's compressor kv (and gate, ratio > 1) and its
        indexer's head weights. Empty for layers without a compressor of their own."""
        if self.compressor is None:
            return []
        out = [self.compressor.wkv] + ([self.compressor.wgate] if self.compressor.wgate is not None else [])
        if self.indexer is not None:
            if not self.v41:
                out += [self.indexer.compressor.wkv, self.indexer.compressor.wgate]
            out.append(self.indexer.weights_proj)
        return out

    def stack_projections(self) -> bool:
        """Put `token_projections` in one buffer (`stack_storage`) so that the GPU reads them with
        one GEMM; before the weights are loaded, after their dtypes are final. The indexer's head
        weights join only when they share the compressors' dtype. Returns whether any were stacked."""
        proj = self.token_projections()
        for group in (proj, proj[:-1]):
            if stack_storage(group):
                self.stacked_projections = group
                return True
        return False

    def _window_rows_fused(self, batch: ForwardBatch) -> bool:
        """Whether every row of the batch is a decode row whose window entry the fused store
        round-trips itself (`_window_fused`): a decode-only batch, or one of verify waves only."""
        if batch.decode is not None:
            return batch.decode.whole and self._window_fused(batch.decode.kv)
        return (bool(batch.waves) and not batch.segments
                and all(self._window_fused(w.kv) for w in batch.waves))

    def _window_fused(self, dkv: DecodeKV) -> bool:
        """Whether a decode group's window rows go through `write_window_fp8`, `write_window_float` or
        `write_window_v41` (round trip, pack and ring store in one launch): the paged kernels' path
        over an fp8 or v41 store with power-of-two scales, or over a float store."""
        if self.v41:
            return self.kv_pow2 and self._v41_kernel_args(dkv) is not None and hasattr(dkv, "slots")
        kargs = self._kernel_args(dkv)
        return (kargs is not None and hasattr(dkv, "slots")
                and (kargs.main_format == "fp8" and self.kv_pow2 or kargs.main_format == "bf16"))

    def _write_window(self, main_format: str, kv, ring, slots, positions) -> torch.Tensor:
        """The fused window store of `_window_fused` rows: kv [B, D] not yet round-tripped."""
        if main_format == "fp8":
            return write_window_fp8(kv, ring, slots, positions, self.rope_dim)
        return write_window_float(kv, ring, slots, positions, self.rope_dim, self.kv_pow2)

    def _kernel_args(self, view, *where):
        """The paged kernels' inputs for these tokens, or None where this layer takes the reference path."""
        get = getattr(view, "kernel_args", None)
        if get is None or self.v41 or getattr(view, "capture", None) is not None:
            return None
        if self.indexer is not None and self.indexer.random_selection is not None:
            return None
        return get(*where)

    def _attend_kernels(self, kargs, q, stored_rows, rows, out_dtype=torch.float32, out=None,
                        like_tokens: int | None = None) -> torch.Tensor:
        """Indexer top-k and sparse attention over the paged store; the tokens' own rows are
        `stored_rows`, earlier window rows come from the ring. [T, H, D] in out_dtype. With
        `like_tokens` (speculative verify rows) each token is scored and attended as in a decode
        launch of that many tokens, so that it computes what a plain decode row computes."""
        lid, pool, idx, tables = self.layer_id, None, None, None
        if self.ratio:
            pool, tables = kargs.pool(lid, "kv"), kargs.tables(lid, "kv")
            if self.indexer is not None:
                idx = indexer_topk_paged(rows["idx_q"], rows["idx_w"], kargs.batch, kargs.pool(lid, "index"),
                                         self.indexer.topk, self.ratio, kargs.index_format, self.indexer.head_dim,
                                         max_visible=(kargs.max_pos + 1) // self.ratio, resident=kargs.resident(lid),
                                         fp4_queries=True, per_token=like_tokens is not None)
        return sparse_attn_paged(q, self.attn_sink, self.scale, kargs.batch, stored_rows, kargs.ring(lid), pool, idx,
                                 self.ratio, kargs.main_format, self.head_dim, self.rope_dim, self.window,
                                 max_pos=kargs.max_pos, tables=tables, out_dtype=out_dtype, out=out,
                                 like_tokens=like_tokens)

    def _attend_segment(self, seg: Segment, seg_id: int, q, kv, positions, rows, share,
                        out_dtype=torch.float32, in_place: bool = False) -> torch.Tensor:
        """[T, H, D]: out_dtype from the kernels (with in_place, written over q), float32 from the
        reference path."""
        layer_kv = seg.kv.layer(self.layer_id)
        kargs = self._kernel_args(seg.kv, seg.start_pos, seg.length)
        if kargs is not None:
            if self.ratio:
                self._append_compressed_v4(seg.start_pos, layer_kv, rows, kargs)
            stored = kargs.encode_window(kv)
            into = q if in_place and q.dtype == out_dtype and q.is_contiguous() else None
            out = self._attend_kernels(kargs, q, stored, rows, out_dtype, out=into)
            layer_kv.write_window(seg.start_pos, stored, stored=True)   # after: the kernels read earlier rows there
            layer_kv.done(seg.end_pos)
            return out
        prev = layer_kv.window_rows(seg.start_pos)
        if seg.window_from is not None:   # CED: the rows before window_from were not computed
            prev = prev[max(0, prev.shape[0] - max(0, seg.start_pos - seg.window_from)):]
        layer_kv.write_window(seg.start_pos, kv)
        keys = torch.cat([prev.to(kv.dtype), kv])
        first_pos = seg.start_pos - prev.shape[0]
        # window: query at position t sees positions [t - window + 1, t], listed oldest first
        # (the reference's order, which fixes the float summation order)
        win_pos = (positions - self.window + 1).clamp(min=0).unsqueeze(1) + torch.arange(self.window, device=kv.device)
        idx = torch.where(win_pos <= positions.unsqueeze(1), win_pos - first_pos, -1)
        if self.ratio:
            compressed = self._compressed_v41 if self.v41 else self._compressed_v4
            entries, comp_idx = compressed(seg, seg_id, layer_kv, positions, rows, share)
            comp_idx = torch.where(comp_idx >= 0, comp_idx + keys.shape[0], -1)
            idx = torch.cat([idx, comp_idx], dim=1)
            keys = torch.cat([keys, entries.to(keys.dtype)])
        out = sparse_attn(q, keys, idx, self.attn_sink, self.scale)
        capture = getattr(seg.kv, "capture", None)
        if capture is not None and self.indexer is not None and seg.end_pos == capture.end_pos:
            self._capture_mass(capture, q, keys, idx, entries.shape[0])
        layer_kv.done(seg.end_pos)
        return out

    def _capture_mass(self, capture, q, keys, idx, n_entries: int) -> None:
        """Attention mass of each compressed entry from the segment's last `last_n` queries."""
        rows = slice(max(0, q.shape[0] - capture.last_n), q.shape[0])
        probs = attention_probs(q[rows], keys, idx[rows], self.attn_sink, self.scale).sum(1)  # [r, K]
        comp = idx[rows] >= keys.shape[0] - n_entries
        entry_ids = (idx[rows] - (keys.shape[0] - n_entries))[comp]
        capture.add(self.layer_id, entry_ids, probs[comp], n_entries)

    def _attend_decode(self, dkv: DecodeKV, q, kv, rows, fused: tuple[str, ...] = ()) -> torch.Tensor:
        """One token for each of B requests at once (V4; the same math as _attend_segment). The
        compressors named in `fused` (see `_fused_compressors`) update in one launch each."""
        lid, pos = self.layer_id, dkv.positions
        kargs = self._kernel_args(dkv)
        if kargs is not None:
            self._compress_decode_kernels(kargs, dkv, rows, fused)
            # ring row pos % W held pos − W, which no window reads any more
            if self._window_fused(dkv):
                stored = self._write_window(kargs.main_format, kv, kargs.ring(lid), dkv.slots, dkv.positions)
            else:
                stored = kargs.encode_window(kv)
                dkv.write_window(lid, stored)
            out = self._attend_kernels(kargs, q, stored, rows)
            dkv.done(lid)
            return out
        keys, valid = dkv.window(lid, kv)                                  # [B, W, D], [B, W]
        if self.compressor is not None:
            n_entries = (pos + 1) // self.ratio
            self._compress_decode(dkv, "kv", self.compressor, rows["comp_kv"], rows["comp_score"])
            if self.indexer is not None:
                self._compress_decode(dkv, "index", self.indexer.compressor, rows["idx_kv"], rows["idx_score"])
                index_keys = dkv.entries(lid, "index", n_entries)          # [B, N, di]
                scores = self.indexer.ablate((torch.einsum("bhd,bnd->bhn", rows["idx_q"].float(),
                                                           index_keys.float()).relu_()
                                              * rows["idx_w"].float().unsqueeze(-1)).sum(1))
                cols = torch.arange(scores.shape[1], device=kv.device)
                hidden = cols >= n_entries.unsqueeze(1)
                resident = dkv.resident(lid, scores.shape[1])
                if resident is not None:  # a memory policy keeps only some entries on the device
                    hidden = hidden | ~resident
                scores = scores.masked_fill(hidden, float("-inf"))
                k = min(self.indexer.topk, scores.shape[1])
                top = scores.topk(k, dim=-1)
                sel, sel_ok = top.indices, top.values > float("-inf")
                comp = dkv.gather_entries(lid, "kv", torch.where(sel_ok, sel, 0))
            else:
                comp = dkv.entries(lid, "kv", n_entries)
                sel_ok = torch.arange(comp.shape[1], device=kv.device) < n_entries.unsqueeze(1)
            keys = torch.cat([keys, comp.to(keys.dtype)], dim=1)
            valid = torch.cat([valid, sel_ok], dim=1)
        return self._decode_attention(dkv, q, keys, valid)

    def _compress_decode_kernels(self, kargs, dkv: DecodeKV, rows, fused: tuple[str, ...] = ()) -> None:
        """A decode group's compressor updates on the paged kernels' path, the entries its tokens
        complete stored (decode positions lie past every prefix hit: nothing here is shared)."""
        if self.compressor is None:
            return
        parts = [("kv", self.compressor, rows["comp_kv"], rows["comp_score"])]
        if self.indexer is not None:
            parts.append(("index", self.indexer.compressor, rows["idx_kv"], rows["idx_score"]))
        for kind, compressor, kv_rows, score_rows in parts:
            if kind in fused:
                self._compress_decode_fused(kargs, dkv, kind, compressor, kv_rows, score_rows)
            else:
                self._compress_decode(dkv, kind, compressor, kv_rows, score_rows,
                                      self._decode_writer(kargs, dkv, kind, compressor))

    def _attend_waves(self, waves: list[DecodeGroup], q, kv, rows, fused: tuple[str, ...], o: torch.Tensor) -> None:
        """Speculative verify rows (engine/speculative.py), written into o. Each row attends as a
        plain decode row at its position would: over the window rows up to it and the compressed
        entries complete there. On the paged kernels' path (the views' `wave_rows`) the compressors update wave
        after wave (a row's update follows the rows before it, and a wave's states are kept for the
        rollback), then one launch each selects and attends for every row of every wave, reading the
        window rows of earlier verify positions from the rows themselves, and the rows go into the
        ring last (a verify row's ring slot may hold a row that an earlier verify row still reads).
        An entry that a later row completes is already stored when an earlier row attends, but lies
        past the earlier row's visible count. Elsewhere the waves run one after another, each one
        plain decode step's attention."""
        lid, views = self.layer_id, [w.kv for w in waves]
        joint = None
        if all(self._kernel_args(v) is not None for v in views):
            joint = views[0].wave_rows(views)
        together = getattr(views[0], "wave_window", None) if self.compressor is None and joint is None else None
        window, at = None, None
        if joint is not None or together is not None:
            spans = [w.span for w in waves]
            if all(s is not None for s in spans) and all(a[1] == b[0] for a, b in zip(spans, spans[1:])):
                at = slice(spans[0][0], spans[-1][1])     # the waves' rows are one span, wave after wave
            else:
                at = torch.cat([w.rows for w in waves])
            window = together(views, kv[at]) if together is not None else None
        if window is not None:
            # a window-only layer over views that list every wave's window at once (the MTP block's)
            o[at] = self._sparse_rows(q[at], *window, like_tokens=views[0].positions.shape[0]).to(o.dtype)
            for v in views:
                v.done(lid)
            return
        if joint is None:
            for wave in waves:
                r = wave.index()
                o[r] = self._attend_decode(wave.kv, q[r], kv[r], {k: v[r] for k, v in rows.items()},
                                           fused).to(o.dtype)
            return
        q_at, kv_at, rows_at = q[at], kv[at], {k: v[at] for k, v in rows.items()}
        if not self._compress_waves_fused(views, rows_at, fused):
            for wave in waves:
                r = wave.index()
                self._compress_decode_kernels(self._kernel_args(wave.kv), wave.kv,
                                              {k: v[r] for k, v in rows.items()}, fused)
        kargs, ring = joint.args, self._kernel_args(views[0]).ring(lid)
        if self._window_fused(waves[0].kv):     # stored once, into the segments' own rows as well
            own = torch.empty(kv_at.shape[0], 1, ring.shape[-1], dtype=ring.dtype, device=ring.device)
            stored = self._write_window(kargs.main_format, kv_at, own, joint.own_rows, joint.own_rows)
            own = own.view(kv_at.shape[0], -1)
        else:
            stored = kargs.encode_window(kv_at)
            own = torch.empty_like(stored)
            own[joint.own_rows] = stored
        into = o[at] if isinstance(at, slice) and o[at].is_contiguous() else None
        out = self._attend_kernels(kargs, q_at, own, rows_at, out_dtype=o.dtype, out=into,
                                   like_tokens=views[0].positions.shape[0])
        if into is None or out.data_ptr() != into.data_ptr():     # (the kernels wrote it there)
            o[at] = out
        ring[joint.ring_slots, joint.ring_rows] = stored.view(*joint.ring_rows.shape, -1)
        for v in views:
            v.done(lid)

    def _decode_attention(self, dkv: DecodeKV, q, keys, valid, widths: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, H, D] over each request's own keys [B, L, D] where `valid` [B, L]. With `widths` [B],
        row b attends over its first widths[b] columns only (the rest are invalid), rows of one width
        in one call: the softmax and value sums then run over exactly the columns, in the order, a
        one-token segment gives them, so the result is the segment's to the bit."""
        if widths is None or bool((widths == keys.shape[1]).all()):
            out = self._sparse_rows(q, keys, valid)
        else:
            out = q.new_empty(q.shape, dtype=torch.float32)
            for w in widths.unique().tolist():
                r = (widths == w).nonzero().squeeze(1)
                out[r] = self._sparse_rows(q[r], keys[r, :w], valid[r, :w])
        dkv.done(self.layer_id)
        return out

    def _sparse_rows(self, q, keys, valid, like_tokens: int | None = None) -> torch.Tensor:
        b, length, _ = keys.shape
        flat_idx = arange(b * length, device=keys.device, dtype=torch.int32).view(b, length)   # the kernel's dtype
        return sparse_attn(q, keys.reshape(b * length, -1), torch.where(valid, flat_idx, -1), self.attn_sink,
                           self.scale, like_tokens=like_tokens)

    def _attend_decode_v41(self, dkv: DecodeKV, q, kv, rows, share: CrossLayerShare) -> torch.Tensor:
        """V4.1, one token for each of B requests at once (the same math as `_compressed_v41`): a Full
        layer stores the entries its tokens complete; then the source's entries are selected by this
        layer's indexer (Full, Reindex) or by the last indexer's top-k of this decode group (Reuse)."""
        pos = dkv.positions
        sel = None
        kargs = self._v41_kernel_args(dkv)
        if self.ratio:
            if self.mode == "full":
                self._append_global_kv_decode(dkv, rows, kargs)
            if self.indexer is None:
                sel = share.topk[DECODE_GROUP]
            else:
                ind = self.indexer
                pool = share.candidates.get(DECODE_GROUP) if ind.uses_candidates else None
                if kargs is None:
                    index_keys = dkv.entries(self.kv_source, "index", (pos + 1) // self.ratio)   # [B, N, di]
                    sel, published = ind.select_batched(rows["idx_q"], rows["idx_w"], index_keys, pos, pool)
                else:                       # scored over the stored keys in place
                    index_pool, n_max = kargs.pool(self.kv_source, "index"), (kargs.max_pos + 1) // self.ratio
                    if pool is None and not ind.publishes_pool and ind.random_selection is None:
                        # a plain causal top-k in position order: V4's kernels score and select it
                        # (int32 ids, ascending, −1 padded), the entries `select_scored` would choose
                        sel, published = indexer_topk_paged(rows["idx_q"], rows["idx_w"], kargs.batch, index_pool,
                                                            ind.topk, self.ratio, kargs.index_format, ind.head_dim,
                                                            max_visible=n_max, fp4_queries=True), None
                    else:
                        scores = paged_scores(rows["idx_q"], rows["idx_w"], kargs.batch, index_pool, self.ratio,
                                              kargs.index_format, ind.head_dim, max_visible=n_max, fp4_queries=True)
                        sel, published = ind.select_scored(scores, pos, pool)
                if published is not None:
                    share.candidates[DECODE_GROUP] = published
                if kargs is not None:       # the kernels' index type, converted once for the layers that reuse it
                    sel = sel.to(torch.int32)
                share.topk[DECODE_GROUP] = sel
        if kargs is not None:
            return self._attend_kernels_v41(kargs, dkv, q, kv, sel)
        keys, valid = dkv.window(self.layer_id, kv)                        # [B, W, D], [B, W]
        if self.ratio:
            comp = dkv.gather_entries(self.kv_source, "kv", sel.clamp(min=0))
            # a one-token segment lists min(top-k, visible) entry columns (its selection's width)
            widths = self.window + ((pos + 1) // self.ratio).clamp(max=self.indexer_topk)
            keys = torch.cat([keys, comp.to(keys.dtype)], dim=1)
            valid = torch.cat([valid, sel >= 0], dim=1)
            return self._decode_attention(dkv, q, keys, valid, widths)
        return self._decode_attention(dkv, q, keys, valid)

    def _v41_kernel_args(self, dkv: DecodeKV):
        """The paged kernels' inputs for a V4.1 decode group (a store in the packed "v41" layout on
        the kernels' path), or None where it takes the reference path."""
        get = getattr(dkv, "kernel_args", None)
        if get is None or getattr(dkv, "capture", None) is not None:
            return None
        kargs = get()
        return kargs if kargs is not None and kargs.main_format == "v41" else None

    def _attend_kernels_v41(self, kargs, dkv: DecodeKV, q, kv, sel: torch.Tensor | None) -> torch.Tensor:
        """V4.1 decode attention read from the packed store: the window from this layer's ring (the
        tokens' own rows as stored), the selected entries `sel` [B, k] (−1 = none) from the kv
        source's pool. The selection was scored over the source's stored index keys by the paged
        kernels (`paged_scores`) and chosen by the indexer's own rules (`LatentIndexer.select_scored`)."""
        lid, src = self.layer_id, self.kv_source
        # ring row pos % W held pos − W, which no window reads any more
        if self._window_fused(dkv):
            stored = write_window_v41(kv, kargs.ring(lid), dkv.slots, dkv.positions)
        else:
            stored = kargs.encode_window(kv)
            dkv.write_window(lid, stored)
        out = sparse_attn_paged(q, self.attn_sink, self.scale, kargs.batch, stored, kargs.ring(lid),
                                kargs.pool(src, "kv") if self.ratio else None, sel, self.ratio, "v41",
                                self.head_dim, 0, self.window, max_pos=kargs.max_pos,
                                tables=kargs.tables(src, "kv") if self.ratio else None)
        dkv.done(lid)
        return out

    def _append_global_kv_decode(self, dkv: DecodeKV, rows, kargs=None) -> None:
        """`_append_global_kv` for a decode group: the requests whose token completes a block store
        its global KV and indexer keys. On the paged kernels' path (`kargs`) with fixed shapes and no
        host synchronisation (what a CUDA graph captures): every request's candidate entry is
        computed, and written where its entry id is not −1 (`PagedDecodeKV.write_entries`)."""
        pos = dkv.positions
        if kargs is not None:
            def write(which, entry_ids, latent, freqs=None):
                if freqs is None:
                    freqs = rope_freqs(entry_ids.clamp(min=0) * self.ratio, self.inv_freq)
                dkv.write_entries(self.layer_id, "index", which, entry_ids, self.indexer.keys(latent, freqs))
                dkv.write_entries(self.layer_id, "kv", which, entry_ids, global_kv(latent, freqs))

            if self.compressor.stateless:         # every token completes an entry (ratio 1)
                # but position 0: there only a CUDA graph's padding rows decode (a request decodes
                # past its prompt), with block table 0, whose entry 0 belongs to a request
                write(torch.arange(pos.shape[0], device=pos.device),
                      torch.where(pos > 0, torch.div(pos, self.ratio, rounding_mode="floor"), -1), rows["comp_kv"],
                      rows.get("comp_freqs"))
                return
            if hasattr(dkv, "state_tensors"):   # the state updated in place and the block finished in one launch
                done = compress_decode_latent(*dkv.state_tensors(self.layer_id, "kv"), dkv.slots, pos, rows["comp_kv"],
                                              rows["comp_score"], self.ratio, self.compressor.norm.weight,
                                              self.compressor.norm.eps, self.compressor.out_dtype)
                if done is not None:
                    latent, entry_ids = done
                    write(torch.arange(pos.shape[0], device=pos.device), entry_ids, latent)
                    return
            st_kv, st_score = dkv.compressor_state(self.layer_id, "kv")
            # a request that completes no block pools a partial state (NaN where its scores are all
            # −inf): any finite row will do there, `write_entries` keeps the pool's row
            self.compressor.update_decode(
                st_kv, st_score, rows["comp_kv"], rows["comp_score"], pos, self.inv_freq,
                write=lambda block_rows, starts, requests, ids: write(requests.long(), ids, torch.where(
                    (ids >= 0).unsqueeze(-1), self.compressor.finish(block_rows, starts, self.inv_freq), 0.0)))
            dkv.store_compressor_state(self.layer_id, "kv", st_kv, st_score)
            return
        if self.compressor.stateless:
            which, latent = torch.arange(pos.shape[0], device=pos.device), rows["comp_kv"]
        else:
            st_kv, st_score = dkv.compressor_state(self.layer_id, "kv")
            which, latent = self.compressor.update_decode(st_kv, st_score, rows["comp_kv"], rows["comp_score"], pos,
                                                          self.inv_freq)
            dkv.store_compressor_state(self.layer_id, "kv", st_kv, st_score)
        if which.numel():
            entry_ids = pos[which] // self.ratio
            freqs = rope_freqs(entry_ids * self.ratio, self.inv_freq)
            dkv.append_entries(self.layer_id, "index", which, entry_ids, self.indexer.keys(latent, freqs))
            dkv.append_entries(self.layer_id, "kv", which, entry_ids, global_kv(latent, freqs))

    def _record_rows(self, dkv: DecodeKV, kind: str, rows_kv, rows_score) -> None:
        """Hand a decode group's compressor input rows to a view that records them before the update
        (verify rows, which may be rolled back: engine/speculative.py, engine/spec_graphs.py)."""
        record = getattr(dkv, "record_compressor_rows", None)
        if record is not None:
            record(self.layer_id, kind, rows_kv, rows_score)

    def _compress_decode(self, dkv: DecodeKV, kind: str, compressor: Compressor, rows_kv, rows_score,
                         write=None) -> None:
        self._record_rows(dkv, kind, rows_kv, rows_score)
        st_kv, st_score = dkv.compressor_state(self.layer_id, kind)
        which, entries = compressor.update_decode(st_kv, st_score, rows_kv, rows_score, dkv.positions, self.inv_freq,
                                                  write)
        dkv.store_compressor_state(self.layer_id, kind, st_kv, st_score)
        if entries is not None and which.numel():
            dkv.append_entries(self.layer_id, kind, which, dkv.positions[which] // self.ratio, entries)

    def _fused_compressors(self, dkv: DecodeKV) -> tuple[str, ...]:
        """The compressors ("kv", "index") whose decode step runs as one `compress_decode_paged` launch
        (state update, block completion, store, position bias): V4 on the paged kernels' path over
        packed or float pools, with the kernels running."""
        kargs = None if self.compressor is None else self._kernel_args(dkv)
        if kargs is None or not hasattr(dkv, "state_tensors"):
            return ()
        parts = [("kv", self.compressor, kargs.main_format)]
        if self.indexer is not None:
            parts.append(("index", self.indexer.compressor, kargs.index_format))
        return tuple(kind for kind, comp, fmt in parts
                     if compress_decode_ok(dkv.positions, comp.head_dim, self.rope_dim,
                                           "index" if comp.rotate else "main", self.kv_pow2, fmt))

    def _compress_decode_fused(self, kargs, dkv: DecodeKV, kind: str, compressor: Compressor, rows_kv,
                               rows_score, waves: int = 1) -> None:
        """One compressor's decode update in one launch; with `waves` > 1 every verify wave's (dkv the
        first wave's view, rows_kv/rows_score every wave's rows, wave after wave: `_compress_waves_fused`)."""
        if waves > 1:
            positions, rotation, save = dkv.wave_compressor_inputs(self.layer_id, kind, waves, self.ratio,
                                                                   self.inv_freq, self.rope_key)
        else:
            # a view that keeps the states before the update (speculative verify waves) has the launch
            # copy them; otherwise the view may record the rows (score rows without their position bias here)
            snapshot = getattr(dkv, "state_snapshot", None)
            save = snapshot(self.layer_id, kind) if snapshot is not None else None
            if snapshot is None:
                self._record_rows(dkv, kind, rows_kv, rows_score)
            positions, rotation = dkv.positions, dkv.block_start_rope(self.ratio, self.inv_freq, self.rope_key)
        st_kv, st_score = dkv.state_tensors(self.layer_id, kind)
        compress_decode_paged(st_kv, st_score, dkv.slots, positions, rows_kv, rows_score, self.ratio,
                              compressor.overlap, compressor.norm.weight, compressor.norm.eps, rotation,
                              "index" if compressor.rotate else "main", kargs.pool(self.layer_id, kind),
                              kargs.main_format if kind == "kv" else kargs.index_format,
                              kargs.tables(self.layer_id, kind), kargs.batch.block_tokens // self.ratio,
                              compressor.out_dtype,
                              ape=compressor.ape, save=save, pow2=self.kv_pow2, waves=waves)

    def _compress_waves_fused(self, views: list[DecodeKV], rows, fused: tuple[str, ...]) -> bool:
        """Every verify wave's compressor updates in one launch per compressor, each request's waves
        one after another in its program (rows: every wave's, wave after wave), where both compressors
        fuse and the views offer it (`wave_compressor_inputs`: the fixed-shape verify waves of
        engine/spec_graphs.py, which hold every request in one order). False where the waves update
        one after another instead."""
        kinds = ("kv", "index") if self.indexer is not None else ("kv",)
        first = views[0]
        if (self.compressor is None or len(views) < 2 or set(fused) != set(kinds)
                or not hasattr(first, "wave_compressor_inputs") or any(v.slots is not first.slots for v in views)):
            return False
        kargs = self._kernel_args(first)
        parts = {"kv": (self.compressor, rows["comp_kv"], rows["comp_score"])}
        if self.indexer is not None:
            parts["index"] = (self.indexer.compressor, rows["idx_kv"], rows["idx_score"])
        for kind in kinds:
            self._compress_decode_fused(kargs, first, kind, *parts[kind], waves=len(views))
        return True

    def _decode_writer(self, kargs, dkv: DecodeKV, kind: str, compressor: Compressor):
        """How batched decode on the paged path stores the entries its tokens complete, with fixed
        shapes (no per-step list of completing requests): fused into the pool for packed stores,
        otherwise finished here and written where the entry id is not −1."""
        fused = self._paged_writer(kargs, kind, compressor)
        if fused is not None:
            return fused

        def write(block_rows, block_starts, requests, entry_ids):
            dkv.write_entries(self.layer_id, kind, requests.long(), entry_ids,
                              compressor.finish(block_rows, block_starts, self.inv_freq))
        return write

    def _append_compressed_v4(self, start_pos: int, layer_kv: LayerKV, rows, kargs=None) -> None:
        """Run this layer's compressors over the segment's rows and store the entries they complete
        (with the paged kernels' inputs and a packed store: finished and packed straight into the pool)."""
        parts = [("kv", self.compressor, rows["comp_kv"], rows["comp_score"])]
        if self.indexer is not None:
            parts.append(("index", self.indexer.compressor, rows["idx_kv"], rows["idx_score"]))
        frozen = layer_kv.seq.frozen_until // self.ratio if kargs is not None else 0
        record = getattr(layer_kv, "record_compressor_rows", None)   # a store that may roll tokens back
        note = getattr(layer_kv, "note_compressor_rows", None)       # a store that snapshots inside segments
        for kind, compressor, kv_rows, score_rows in parts:
            if record is not None:
                record(kind, start_pos, kv_rows, score_rows)
            if note is not None:
                note(kind, start_pos, kv_rows, score_rows)
            write = self._paged_writer(kargs, kind, compressor, frozen)
            first, new = compressor.update(layer_kv.compressor_state(kind), kv_rows, score_rows, start_pos,
                                           self.inv_freq, write)
            if new is not None and new.shape[0]:
                layer_kv.append_entries(kind, first, new)

    def _paged_writer(self, kargs, kind: str, compressor: Compressor, first_writable: int = 0):
        """`write(rows, block_starts, requests[, entry_ids])` for a compressor: the fused pool → norm →
        RoPE → quantise → pack → store of `compress_paged` into this layer's pool, for packed stores read
        by the paged kernels; None otherwise. Entries below `first_writable` (a prefix hit's, in blocks
        other requests may share) are left alone; entry id −1 (given by fixed-shape decode) is not stored."""
        fmt = None if kargs is None else (kargs.main_format if kind == "kv" else kargs.index_format)
        if fmt not in ("fp8", "fp4"):
            return None
        pool, tables = kargs.pool(self.layer_id, kind), kargs.tables(self.layer_id, kind)
        per_block = kargs.batch.block_tokens // self.ratio

        def write(block_rows, block_starts, requests, entry_ids=None):
            if entry_ids is None:
                entry_ids = torch.div(block_starts, self.ratio, rounding_mode="floor")
            if first_writable:
                keep = entry_ids >= first_writable
                block_rows = tuple(t[keep] for t in block_rows)
                block_starts, requests, entry_ids = block_starts[keep], requests[keep], entry_ids[keep]
            compress_paged(*block_rows, compressor.norm.weight, compressor.norm.eps,
                           rope_freqs(block_starts, self.inv_freq), "index" if compressor.rotate else "main", pool,
                           fmt, tables, requests, entry_ids.to(torch.int32), per_block, compressor.out_dtype)
        return write

    def _compressed_v4(self, seg: Segment, seg_id: int, layer_kv: LayerKV, positions, rows, share):
        """This layer's own entries; CSA: the indexer's top-k of them, HCA: all visible ones."""
        self._append_compressed_v4(seg.start_pos, layer_kv, rows)
        n_entries = seg.end_pos // self.ratio
        entries = layer_kv.entries("kv", n_entries)
        if self.indexer is not None:
            comp_idx = self.indexer.select(rows["idx_q"], rows["idx_w"], layer_kv.entries("index", n_entries),
                                           positions)
        else:
            cols = torch.arange(n_entries, device=positions.device)
            comp_idx = torch.where(cols.unsqueeze(0) < ((positions + 1) // self.ratio).unsqueeze(1), cols, -1)
        return entries, comp_idx

    def _append_global_kv(self, start_pos: int, layer_kv: LayerKV, comp_kv, comp_score) -> None:
        """A V4.1 Full layer: feed one segment's compressor rows, store the entries they complete
        (global KV and indexer keys)."""
        state = None if self.compressor.stateless else layer_kv.compressor_state("kv")
        note = getattr(layer_kv, "note_compressor_rows", None)
        if state is not None and note is not None:
            note("kv", start_pos, comp_kv, comp_score)
        first, latent = self.compressor.update(state, comp_kv, comp_score, start_pos, self.inv_freq)
        if latent.shape[0]:
            starts = torch.arange(first, first + latent.shape[0], device=latent.device) * self.ratio
            freqs = rope_freqs(starts, self.inv_freq)
            layer_kv.append_entries("index", first, self.indexer.keys(latent, freqs))
            layer_kv.append_entries("kv", first, global_kv(latent, freqs))

    def _compressed_v41(self, seg: Segment, seg_id: int, layer_kv: LayerKV, positions, rows,
                        share: CrossLayerShare):
        """The kv source's entries, selected by this layer's indexer or the last one's top-k."""
        if self.mode == "full" and "comp_kv" in rows:   # (under CED the source's update ran already)
            self._append_global_kv(seg.start_pos, layer_kv, rows["comp_kv"], rows.get("comp_score"))
        source = seg.kv.layer(self.kv_source)
        n_entries = seg.end_pos // self.ratio
        entries = source.entries("kv", n_entries)
        if self.indexer is None:
            return entries, share.topk[seg_id]
        if n_entries == 0:
            comp_idx = torch.empty(positions.shape[0], 0, dtype=torch.long, device=positions.device)
        else:
            pool = share.candidates.get(seg_id) if self.indexer.uses_candidates else None
            comp_idx, published = self.indexer.select(rows["idx_q"], rows["idx_w"], source.entries("index", n_entries),
                                                      positions, pool)
            if published is not None:
                share.candidates[seg_id] = published
        share.topk[seg_id] = comp_idx
        return entries, comp_idx
