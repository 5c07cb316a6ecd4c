"""DeepSeek-V4.1 CED prefill: the decoder layers run only over the rows whose results are read.

In V4.1 the layers from the last kv source layer on (the *decoder*) attend over global KV that the
source layer's compressor projects from its input, the encoder's last output. Everything else a
decoder layer keeps per token is its sliding window. So a forward need only run the decoder over
the rows whose outputs are returned (`ForwardBatch.outputs`) and those whose window state a later
step reads: the window before the end of a segment whose state is read (`Segment.state_read`: the
next chunk, a prefix-cache snapshot) and before each snapshot point inside a segment. The source
layer's compressor still runs over every row. The engine cuts a chunk at a snapshot point only
where that lets the decoder skip rows (`cuts_that_skip`).

The dependency cone. The window row of decoder layer d at position p comes from layer d−1's output
at p, which attends over layer d−1's window rows [p − W + 1, p]. A range that starts at r without
the window rows before it (they were skipped) is therefore exact at layer d only from
r + (d + 1)(W − 1) on. With D decoder layers, a range that must be exact from position a (an
output row, or end − 1 for the state at end: the window rows [end − W, end) of every layer) starts
at a − D(W − 1). Ranges that touch or overlap are merged, and a range reaching back to the first
row of its request's rows in the batch starts there and reads the window ring as usual (the
previous forward left it exact). Rows of a range before its exact part are computed with the
window they have (`Segment.window_from`) and never read.

Every decoder layer runs over the same rows (`CedPlan.batch`), so the per-row hand-offs between
layers (top-k, candidate pool: `CrossLayerShare`) line up without remapping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.config import ModelConfig
from hybridkv.model.state import DecodeGroup, ForwardBatch, Segment


def decoder_start(config: ModelConfig) -> int | None:
    """The first decoder layer: V4.1's last kv source layer (None for V4 or without sources)."""
    if config.family != "v4.1" or not config.kv_source_layer_ids:
        return None
    return max(config.kv_source_layer_ids)


@dataclass
class CedPlan:
    """Which rows of `full` the decoder layers run over, as the sub-batch `batch`."""

    full: ForwardBatch
    source: int                          # the first decoder layer (the last kv source)
    rows: torch.Tensor                   # [R] flat rows of `full` the decoder runs over, in order
    batch: ForwardBatch                  # those rows as segments (the decoder's batch)
    sub_of: list[int | None]             # full segment index -> index in batch.segments (None: skipped)
    num_layers: int                      # decoder layers
    comp: dict[str, torch.Tensor] = field(default_factory=dict)   # source compressor rows over `full`

    @property
    def skipped_rows(self) -> int:
        """Rows of the forward each decoder layer does not run."""
        return self.full.num_tokens - int(self.rows.numel())


def reach(config: ModelConfig) -> int:
    """How far before a row whose decoder state must be exact the decoder's rows start: D(W − 1)."""
    return (config.num_hidden_layers - decoder_start(config)) * (config.sliding_window - 1)


def cuts_that_skip(config: ModelConfig, points: list[int], end: int) -> list[int]:
    """Of the snapshot points inside a chunk that ends at position `end` (sorted), those at which
    cutting it into segments lets the decoder skip rows: where the next point (or the chunk's end)
    lies more than a reach past it. At the others the chunk runs on whole (its layers keep the
    state there from its rows) and the decoder runs through."""
    r = reach(config)
    nxt = [*points[1:], end]
    return [p for p, n in zip(points, nxt) if n - 1 - r > p]


def _ranges(config: ModelConfig, batch: ForwardBatch, outputs: list[int]) -> list[tuple[int, int, bool]]:
    """(first row, end row, reads the ring) of each decoder range, in row order."""
    reach_back = reach(config)
    out_rows = sorted(outputs)
    ranges: list[tuple[int, int, bool]] = []
    i, n = 0, len(batch.segments)
    while i < n:   # one request's consecutive segments at consecutive positions
        j = i + 1
        while (j < n and batch.segments[j].kv is batch.segments[i].kv
               and batch.segments[j].start_pos == batch.segments[j - 1].end_pos):
            j += 1
        group = batch.segments[i:j]
        first_row = group[0].start
        # (anchor row, end of its segment): a range is exact from its anchor on and ends where its
        # segment does, so every decoder segment is a suffix of a segment of the forward
        anchors = [(seg.start + seg.length - 1, seg.start + seg.length) for seg in group if seg.state_read]
        # snapshot points inside a segment (where a cut would not let the decoder skip rows, the
        # chunk runs whole through them): their state is read too
        anchors += [(seg.start + p - seg.start_pos - 1, seg.start + seg.length) for seg in group
                    for p in getattr(seg.kv, "snapshot_points", ()) if seg.start_pos < p < seg.end_pos]
        anchors += [(r, seg.start + seg.length) for seg in group for r in out_rows
                    if seg.start <= r < seg.start + seg.length]
        spans: list[list[int]] = []
        for a, end in sorted(set(anchors)):
            lo = max(first_row, a - reach_back)
            if spans and lo <= spans[-1][1]:
                spans[-1][1] = max(spans[-1][1], end)
            else:
                spans.append([lo, end])
        ranges.extend((lo, hi, lo == first_row) for lo, hi in spans)
        i = j
    return ranges


def plan(config: ModelConfig, batch: ForwardBatch) -> CedPlan | None:
    """The decoder's rows for this forward, or None where it must run over every row (no outputs
    declared, V4, attention capture). A decode group's rows are all kept (each is an output and its
    state is read), after the segments' kept rows."""
    source = decoder_start(config)
    if source is None or batch.outputs is None or batch.static:
        return None
    if any(getattr(seg.kv, "capture", None) is not None for seg in batch.segments):
        return None
    ranges = _ranges(config, batch, batch.outputs)
    kept = sum(hi - lo for lo, hi, _ in ranges)
    if kept == sum(seg.length for seg in batch.segments):
        return None
    segments: list[Segment] = []
    sub_of: list[int | None] = []
    rows: list[torch.Tensor] = []
    out_row = 0
    for seg in batch.segments:
        a, b = seg.start, seg.start + seg.length
        pieces = [(max(a, lo), min(b, hi), lo, reads) for lo, hi, reads in ranges if lo < b and hi > a]
        if not pieces:
            sub_of.append(None)
            continue
        (lo, hi, range_lo, reads), = pieces   # ranges end at segment ends: one piece at most
        start_pos = seg.start_pos + (lo - a)
        window_from = None if reads else seg.start_pos + (range_lo - a)
        sub_of.append(len(segments))
        segments.append(Segment(seg.kv, out_row, hi - lo, start_pos, seg.state_read, window_from))
        rows.append(torch.arange(lo, hi))
        out_row += hi - lo
    row_idx = torch.cat(rows).to(batch.positions.device)
    decode = None
    if batch.decode is not None:
        # the decode rows keep their place among the kept rows (in full-row order), so the decoder's
        # batch has the rows, in the order, it has when those rows run as one-token segments
        d_rows = batch.decode.rows.to(row_idx.device)
        row_idx, order = torch.cat([row_idx, d_rows]).sort()
        new_row = torch.empty_like(order)
        new_row[order] = torch.arange(order.numel(), device=order.device)
        decode = DecodeGroup(new_row[-d_rows.numel():], batch.decode.kv)
        seg_rows = new_row[:-d_rows.numel()]
        for seg in segments:
            seg.start = int(seg_rows[seg.start])
    sub = ForwardBatch(segments, batch.positions[row_idx], decode)
    return CedPlan(batch, source, row_idx, sub, sub_of, config.num_hidden_layers - source)


def remap_share(share, p: CedPlan):
    """The encoder's per-segment hand-offs (top-k, candidate pool) restricted to the decoder's rows,
    keyed by the decoder's segments (a decoder Reindex layer may use an encoder candidate source)."""
    from hybridkv.model.csa2 import CrossLayerShare
    out = CrossLayerShare()
    for s_full, s in enumerate(p.sub_of):
        if s is None:
            continue
        seg_full, seg = p.full.segments[s_full], p.batch.segments[s]
        local = slice(seg.start_pos - seg_full.start_pos, seg.start_pos - seg_full.start_pos + seg.length)
        if s_full in share.topk:
            out.topk[s] = share.topk[s_full][local]
        if s_full in share.candidates:
            out.candidates[s] = share.candidates[s_full][local]
    from hybridkv.model.attention import DECODE_GROUP   # the decode group's rows are all kept, in order
    for src, dst in ((share.topk, out.topk), (share.candidates, out.candidates)):
        if DECODE_GROUP in src:
            dst[DECODE_GROUP] = src[DECODE_GROUP]
    return out


def token_weight_flops(block, runs_compressor: bool = True) -> int:
    """Matmul FLOPs one token spends on a block's weights: 2 per weight element it multiplies (the
    mHC mixes, the attention and indexer projections, the gate, the shared expert and top-k routed
    experts). Attention over the window and the entries, and the indexer's scoring, come on top
    (they grow with the context) and are not counted. `runs_compressor=False` leaves out the
    compressor's projection (CED's source layer still runs it over every row)."""
    from hybridkv.model.linear import Linear
    attn, moe = block.attn, block.ffn
    skip = set() if runs_compressor or attn.compressor is None else {id(m) for m in attn.compressor.modules()}
    n = block.hc_attn_fn.numel() + block.hc_ffn_fn.numel() + moe.gate.weight.numel()
    n += sum(m.in_features * m.out_features for m in attn.modules() if isinstance(m, Linear) and id(m) not in skip)
    if attn.indexer is not None and hasattr(attn.indexer, "wk"):   # keys are derived per entry, from the latent
        n -= attn.indexer.wk.in_features * attn.indexer.wk.out_features
    def size(e) -> int:   # (a rank's share of) one expert
        return 0 if e is None else sum(m.in_features * m.out_features for m in e.modules() if isinstance(m, Linear))
    n += size(moe.shared_experts) + size(moe.experts[0]) * moe.gate.topk
    return 2 * n


def skipped_flops(model, p: CedPlan | None) -> int:
    """The weight matmul FLOPs (`token_weight_flops`) the plan's forward did not spend: every skipped
    row, on every decoder layer (the source layer's compressor aside, which ran)."""
    if p is None:
        return 0
    per_row = sum(token_weight_flops(model.layers[i], runs_compressor=i != p.source)
                  for i in range(p.source, p.source + p.num_layers))
    return p.skipped_rows * per_row
