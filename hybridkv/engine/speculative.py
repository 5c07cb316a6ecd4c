"""Speculative decoding with V4's MTP block: drafting, acceptance, and the exact rollback of what
rejected draft tokens wrote into the hybrid cache.

A decoding request at position n (its last token x_n sampled, not yet computed) carries up to k
draft tokens d_1..d_k. The main model verifies x_n, d_1..d_k at positions n..n+k in one forward; the
longest prefix of drafts the main model agrees with is accepted, plus the main model's own next
token (greedy: d_i is accepted while it is the argmax; sampled: standard rejection sampling, so
tokens follow the main model's distribution exactly). The request then emits a + 1 tokens and has
computed positions n..n+a.

Verify rows as decode rows (`verify_waves`): the row-wise work of the k+1 rows (projections, MoE,
mHC, norms) runs once over the flat batch, and each layer's attention takes them as k+1 decode
groups, wave j holding the j-th row of every verifying request. Each row thus computes exactly the
attention a plain decode step computes at its position (window, compressor update, indexer top-k
over the entries that exist there). On the paged kernels' path the compressors update wave after
wave and one indexer launch and one attention launch then serve the rows of every wave
(`Attention._attend_waves`); elsewhere, and where a verify chunk reaches a block boundary whose
window state the prefix cache snapshots layer by layer, the waves run one after another. Otherwise a request's rows run as one segment of k+1 tokens (whole, like
any V4 chunk: a block boundary inside it is snapshotted from its rows). `EngineConfig.speculative_verify`
chooses: waves, segments, or auto (waves on CUDA; on the CPU waves where two or more requests verify
in the step, since one request's rows cost less there as one segment: BENCHMARKS.md). Segments also
where batched decode is off or a prefix hit's frozen blocks reach the first verify position.

Drafting (`MTPDrafter`): the MTP block at position t reads the main model's last stream h_t and the
embedding of token t+1 and predicts token t+2. After each step it runs over the positions the step
computed (prefill chunks: only their last `window` positions matter), each with its next token,
which fills its own window ring (the MTP layer is window-only: ratio 0) and yields draft 1 from the
last position. Drafts 2..k chain the same layer one position further on its own output stream and
its own previous draft, as the reference does for k above the number of MTP layers. The chain's
window rows are speculative: the rows it overwrote are put back once the drafts are taken, so the
MTP ring only ever holds rows computed from the main model's streams.

Rollback (`VerifyCheckpoint`): the verify forward commits everything, as any forward does; what the
rejected positions q+1..n+k touched is then undone. Before the forward, the checkpoint copies
(a) the window-ring rows of positions n..n+k of every layer (slot pos % W of a rejected position held
a row the next queries still read), (b) every compressor's partial-block state of the request, and
(c) the stored compressed entries and indexer keys that positions n..n+k can complete. During the
forward the request's view (or its decode waves) records each compressor's per-token input rows.
After acceptance the rejected positions' ring rows and the entries that only rejected tokens completed are written back
from (a) and (c), and each compressor state is reset to (b) and fed the accepted positions' recorded
rows again, which is the state the compressor reaches when it sees only those tokens (its update is
a pure function of the state and the rows). Entries that accepted tokens completed were computed from
accepted rows only and stay. Window-state snapshots taken at a block boundary that a rejected token
crossed are dropped, blocks allocated only for rejected positions go back to the pool, and the
prefix cache registers blocks only up to the accepted positions. Copying costs the k+1 ring rows and
the compressor states per layer (KBs per request for tiny-v4; about 12 MB for V4-Flash's twenty
128-row HCA states) and no second forward.

Numerics: with decode waves a verify row's attention is a plain decode row's; what still differs is
the row count of the row-wise GEMMs (B·(k+1) rows against B). Where those are batch-invariant (the
GPU's deterministic mode) a verify row is a plain decode row to the bit. On the CPU, BLAS rounds a
row differently by the number of rows (one, two or three, four and more; with several threads also
by how the rows split between them), so logits differ by float rounding
(relative 1e-6..1e-5 in float32; on a quantized checkpoint an FP8 activation round trip can turn that
into a whole quantization step). Greedy outputs therefore equal plain decoding's except where the
top two logits tie within that (BENCHMARKS.md has the case measured); the rollback itself is exact
to the bit.

Not combined with: V4.1 (no MTP), offloading memory policies. On CUDA, a step in which every
request verifies k drafts replays one CUDA graph instead (engine/spec_graphs.py: the same waves, the
acceptance on the device, a rollback from state copies); other speculative steps, and every step on
the CPU, run as described here. A sampled request's step draws its uniforms in one call
(`step_uniforms`) on either path, so a seeded request's tokens do not depend on the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore, PagedLayerKV, PagedSeqKV, SeqCache
from hybridkv.engine.sampling import SamplingParams, draw_with_uniforms, filtered_probs
from hybridkv.errors import ConfigError
from hybridkv.model.state import ForwardBatch

def check_supported(model, memory_offloads: bool) -> None:
    """ConfigError naming why this engine cannot speculate with the MTP block, if it cannot."""
    c = model.config
    if c.family != "v4" or not len(model.mtp):
        raise ConfigError(f"speculative 'mtp' drafts with the checkpoint's MTP block; this {c.family} checkpoint has "
                          f"{c.num_nextn_predict_layers} MTP layers (V4.1's DSpark draft layers are not built)")
    if c.num_nextn_predict_layers != 1:
        raise ConfigError(f"speculative 'mtp' chains one MTP layer; this checkpoint has "
                          f"{c.num_nextn_predict_layers} (several MTP layers are not implemented)")
    if c.layer_ratio(c.num_hidden_layers) != 0:
        raise ConfigError(f"the MTP layer compresses (ratio {c.layer_ratio(c.num_hidden_layers)}); speculative 'mtp' "
                          f"keeps only an MTP window (V4's MTP layer is ratio 0)")
    if memory_offloads:
        raise ConfigError("speculative decoding cannot be combined with a memory policy that offloads CSA entries")


# ----- the MTP layer's cache -----
class MTPCache:
    """The window ring of the (window-only) MTP layer for every request slot of a store."""

    def __init__(self, config, max_slots: int, dtype: torch.dtype, device):
        self.layer_id = config.num_hidden_layers
        self.window = config.sliding_window
        self.ring = torch.zeros(max_slots, self.window, config.head_dim, dtype=dtype, device=device)

    def view(self, slot: int, start: int) -> "MTPSeqKV":
        return MTPSeqKV(self, slot, start)

    def rows(self, slot: int, first: int, n: int) -> torch.Tensor:
        return self.ring[slot][torch.arange(first, first + n, device=self.ring.device) % self.window].clone()

    def put_rows(self, slot: int, first: int, rows: torch.Tensor) -> None:
        self.ring[slot][torch.arange(first, first + rows.shape[0], device=self.ring.device) % self.window] = rows


class MTPSeqKV:
    """`SequenceKV` of one request for the MTP block: its window ring, valid from `start` (positions
    before it were never computed: a prefix hit, or a prompt longer than the window)."""

    capture = None

    def __init__(self, cache: MTPCache, slot: int, start: int):
        self.cache, self.slot, self.start = cache, slot, start

    def layer(self, layer_id: int) -> "MTPSeqKV":
        if layer_id != self.cache.layer_id:
            raise RuntimeError(f"the MTP cache holds layer {self.cache.layer_id}, not {layer_id}")
        return self

    def window_rows(self, start_pos: int) -> torch.Tensor:
        first = max(self.start, start_pos - self.cache.window, 0)
        return self.cache.rows(self.slot, first, start_pos - first)

    def write_window(self, start_pos: int, rows: torch.Tensor) -> None:
        keep = min(rows.shape[0], self.cache.window)
        n = rows.shape[0]
        self.cache.put_rows(self.slot, start_pos + n - keep, rows[n - keep:].to(self.cache.ring.dtype))

    def done(self, end_pos: int) -> None:
        pass


# ----- rollback -----
class _RecordingLayerKV(PagedLayerKV):
    def __init__(self, store, seq, layer_id, on_done, rows: dict):
        super().__init__(store, seq, layer_id, on_done)
        self._rows = rows

    def record_compressor_rows(self, kind: str, start_pos: int, kv: torch.Tensor, score: torch.Tensor) -> None:
        self._rows.setdefault((self.layer_id, kind), []).append((start_pos, kv, score))


class RecordingSeqKV(PagedSeqKV):
    """A request's paged view that records its compressors' input rows (for `VerifyCheckpoint`)."""

    def __init__(self, store: PagedKVStore, seq: SeqCache, on_layer_done, rows: dict):
        super().__init__(store, seq, on_layer_done)
        self._layers = [_RecordingLayerKV(store, seq, i, on_layer_done, rows) for i in range(store.num_layers)]


class RecordingDecodeKV(PagedDecodeKV):
    """One verify wave (each request's j-th verify row) as a decode group that records its
    compressors' input rows into each request's checkpoint (`records[b]`: that request's
    `VerifyCheckpoint.rows`), in position order across the waves."""

    def __init__(self, store: PagedKVStore, seqs: list[SeqCache], positions: torch.Tensor, on_layer_done,
                 records: list[dict]):
        super().__init__(store, seqs, positions, on_layer_done)
        self._records = records

    def record_compressor_rows(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        for b, (rows, pos) in enumerate(zip(self._records, self.host_positions)):
            rows.setdefault((layer_id, kind), []).append((pos, kv[b:b + 1], score[b:b + 1]))


def verify_waves(store: PagedKVStore, verifies: list[tuple[SeqCache, int, int, int, dict]],
                 on_layer_done=None) -> list[tuple[RecordingDecodeKV, torch.Tensor, list[int]]]:
    """`ForwardBatch.build`'s waves for verify chunks run as decode rows. `verifies`: per request its
    cache, first position, length, first row in the flat batch and its checkpoint's `rows`; wave j
    holds the j-th row of every request longer than j."""
    waves = []
    for j in range(max(length for _, _, length, _, _ in verifies)):
        live = [v for v in verifies if v[2] > j]
        positions = torch.tensor([start + j for _, start, _, _, _ in live], dtype=torch.long)
        dkv = RecordingDecodeKV(store, [v[0] for v in live], positions, on_layer_done, [v[4] for v in live])
        waves.append((dkv, positions, [row + j for _, _, _, row, _ in live]))
    return waves


def _entry_kinds(store: PagedKVStore, layer_id: int) -> list[str]:
    return list(store.entries[layer_id])


@dataclass
class VerifyCheckpoint:
    """What a verify forward over positions [start, start + length) of one request may change, copied
    before it runs; `rollback(m)` keeps positions [start, start + m) and undoes the rest."""

    store: PagedKVStore
    cache: SeqCache
    start: int
    length: int
    ring: torch.Tensor | None = None                                       # [layers, length, E]
    states: dict = field(default_factory=dict)                             # (layer, kind) -> (kv, score)
    entries: dict = field(default_factory=dict)                            # (layer, kind) -> (ids, stored rows)
    rows: dict = field(default_factory=dict)                               # filled during the forward

    @classmethod
    def take(cls, store: PagedKVStore, cache: SeqCache, start: int, length: int) -> "VerifyCheckpoint":
        cp = cls(store, cache, start, length)
        W = store.config.sliding_window
        slots = torch.arange(start, start + length, device=store.device) % W
        cp.ring = store.rings[:, cache.slot, slots]           # (advanced indexing: a copy)
        for i in range(store.num_layers):
            for kind, (kv, score) in store.states[i].items():
                cp.states[(i, kind)] = (kv[cache.slot].clone(), score[cache.slot].clone())
            r = store.config.layer_ratio(i)
            if not r:
                continue
            # entry j completes at position (j + 1)·r − 1
            ids = list(range((start + r) // r - 1, (start + length) // r))
            if not ids:
                continue
            for kind in _entry_kinds(store, i):
                blocks, offs = cp._where(i, ids)
                codec = store.codec[kind]
                cp.entries[(i, kind)] = (ids, codec.read(store.entries[i][kind], blocks, offs).clone())
        return cp

    def _where(self, layer_id: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        per = self.store.block_tokens // self.store.config.layer_ratio(layer_id)
        dev = self.store.device
        blocks = torch.tensor([self.cache.block_table[j // per] for j in ids], dtype=torch.long, device=dev)
        return blocks, torch.tensor([j % per for j in ids], dtype=torch.long, device=dev)

    def view(self, on_layer_done) -> RecordingSeqKV:
        return RecordingSeqKV(self.store, self.cache, on_layer_done, self.rows)

    def rollback(self, model, m: int) -> None:
        """Keep positions [start, start + m); undo what positions start + m .. start + length − 1 wrote."""
        if m >= self.length:
            return
        store, slot, q = self.store, self.cache.slot, self.start + m - 1      # q: the last kept position
        W = store.config.sliding_window
        rejected = torch.arange(q + 1, self.start + self.length, device=store.device)
        store.rings[:, slot, rejected % W] = self.ring[:, m:]
        for (i, kind), (ids, saved) in self.entries.items():
            r = store.config.layer_ratio(i)
            undo = [n for n, j in enumerate(ids) if (j + 1) * r - 1 > q]
            if undo:
                blocks, offs = self._where(i, [ids[n] for n in undo])
                store.codec[kind].write(store.entries[i][kind], blocks, offs, saved[undo])
        view = PagedSeqKV(store, self.cache)
        for (i, kind), (kv, score) in self.states.items():
            state = view.layer(i).compressor_state(kind)
            state.kv.copy_(kv)
            state.score.copy_(score)
            pieces = self.rows.get((i, kind))
            if not pieces:
                raise RuntimeError(f"layer {i}'s {kind!r} compressor recorded no rows in the verify forward")
            kv_rows = torch.cat([p[1] for p in pieces])[:m]
            score_rows = torch.cat([p[2] for p in pieces])[:m]
            attn = model.layers[i].attn
            comp = attn.compressor if kind == "kv" else attn.indexer.compressor
            # the entries these rows complete are already stored: the state is all that is rebuilt
            comp.update(state, kv_rows, score_rows, self.start, attn.inv_freq, write=_discard)


def _discard(*_args) -> None:
    pass


# ----- acceptance -----
@dataclass
class Draft:
    tokens: list[int]
    probs: list[torch.Tensor] | None     # sampled requests: the draft distribution of each token
    # the probs are views of `SpeculativeGraphs.draft_probs`, which the graph that drew them filled
    on_device: bool = False


def step_uniforms(n: int, generator: torch.Generator | None, device) -> torch.Tensor:
    """The uniforms a sampled request's speculative step draws, in one call on its generator (or the
    device's default one): len(draft) + 1 for the acceptance (`accept`), then k for the next drafts
    (`MTPDrafter`). The speculative graph (engine/spec_graphs.py) draws the same 2k + 1 for a seeded
    request, so that its tokens are the same whichever path its steps take."""
    return torch.rand(n, generator=generator, device=device if generator is None else generator.device)


def accept(logits: torch.Tensor, draft: Draft, params: SamplingParams, uniforms: torch.Tensor | None) -> list[int]:
    """The tokens a verify step emits, from the main model's logits [len(draft) + 1, vocab]: the
    accepted drafts, then the main model's own token (greedy: its argmax; sampled: rejection
    sampling, a token from the residual max(p − q, 0) at the first rejection, else from p). A sampled
    request's `uniforms` [≥ len(draft) + 1]: uniforms[i] tests draft i (accepted when u·q(d) < p(d),
    with probability min(1, p/q)), uniforms[len(draft)] draws the token by inverting the cumulative
    weights, as the speculative graph does."""
    if params.temperature == 0:
        targets = logits.argmax(-1).tolist()        # the first maximum of each row, as `sample` takes
        out = []
        for d, t in zip(draft.tokens, targets):
            if t != d:
                return out + [t]
            out.append(d)
        return out + [targets[len(draft.tokens)]]
    n = len(draft.tokens)
    uniforms = uniforms.to(logits.device)
    last = uniforms[n:n + 1]
    out = []
    for i, d in enumerate(draft.tokens):
        p = filtered_probs(logits[i], params)
        q = draft.probs[i].to(p.device)
        if bool(uniforms[i] * q[d] < p[d]):         # float32, as the graph compares
            out.append(d)
            continue
        residual = (p - q).clamp(min=0)
        if float(residual.sum()) <= 0:
            residual = p
        return out + [int(draw_with_uniforms(residual[None], last))]
    return out + [int(draw_with_uniforms(filtered_probs(logits[n], params)[None], last))]


# ----- drafting -----
@dataclass
class MTPWork:
    """One request's positions for the MTP pass after a step: streams h [n, hc, dim] of positions
    [start, start + n), and whether to draft from the last one (with up to `k` tokens); a sampled
    request's uniforms for its drafts, drawn with its verify step's (`step_uniforms`; None: the
    drafter draws them)."""

    seq: object
    start: int
    h: torch.Tensor
    k: int
    uniforms: torch.Tensor | None = None


class MTPDrafter:
    def __init__(self, model, cache: MTPCache, device, num_speculative_tokens: int):
        """num_speculative_tokens: the engine's k; a sampled request draws k uniforms for its drafts
        whatever its draft length, as the speculative graph does."""
        self.model, self.cache, self.device = model, cache, device
        self.k = num_speculative_tokens

    @torch.inference_mode()
    def run(self, work: list[MTPWork]) -> dict[str, Draft]:
        """Run the MTP block over every request's positions (filling its window), then draft: draft 1
        from the last position, drafts 2..k by chaining. Returns the drafts by request id."""
        if not work:
            return {}
        model = self.model
        items, ids = [], []
        for w in work:
            seq = w.seq
            if seq.mtp_start is None:
                seq.mtp_start = w.start
            n = w.h.shape[0]
            items.append((self.cache.view(seq.cache.slot, seq.mtp_start), w.start, n))
            ids.extend(seq.token_ids[w.start + 1:w.start + n + 1])
        batch = ForwardBatch.build(items, self.device)
        h = model.mtp_forward(torch.cat([w.h for w in work]), torch.tensor(ids, dtype=torch.long, device=self.device),
                              batch)
        drafting = [i for i, w in enumerate(work) if w.k > 0]
        if not drafting:
            return {}
        last = batch.last_rows()[torch.tensor(drafting, device=self.device)]
        streams = h[last]
        logits = model.mtp_logits(streams)
        drafts = {}
        greedy = logits.argmax(-1).tolist()
        for row, i in enumerate(drafting):
            w = work[i]
            seq = w.seq
            if seq.params.temperature > 0 and w.uniforms is None:
                w.uniforms = step_uniforms(self.k, seq.generator, self.device)
            drafts[seq.request_id] = Draft([], [] if seq.params.temperature > 0 else None)
            self._take(drafts[seq.request_id], logits[row], w, greedy[row])
        chain = [work[i] for i in drafting]
        k_max = max(w.k for w in chain)
        if k_max > 1:
            self._chain(chain, streams, drafts, k_max)
        return drafts

    def _chain(self, chain: list[MTPWork], streams: torch.Tensor, drafts: dict[str, Draft], k_max: int) -> None:
        """Drafts 2..k: the MTP layer one position on, on its own output stream and previous draft.
        The window rows the chain writes are speculative and are restored afterwards."""
        saved = []
        for w in chain:
            first = w.seq.num_tokens - 1    # draft 1 came from position num_tokens − 2; the chain runs on
            saved.append((w.seq.cache.slot, first, self.cache.rows(w.seq.cache.slot, first, w.k - 1)))
        for j in range(1, k_max):
            live = [r for r, w in enumerate(chain) if w.k > j]
            items, ids = [], []
            for r in live:
                seq = chain[r].seq
                pos = seq.num_tokens - 2 + j
                items.append((self.cache.view(seq.cache.slot, seq.mtp_start), pos, 1))
                ids.append(drafts[seq.request_id].tokens[-1])
            batch = ForwardBatch.build(items, self.device)
            idx = torch.tensor(live, device=self.device)
            out = self.model.mtp_forward(streams[idx], torch.tensor(ids, dtype=torch.long, device=self.device), batch)
            logits = self.model.mtp_logits(out)
            greedy = logits.argmax(-1).tolist()
            for row, r in enumerate(live):
                self._take(drafts[chain[r].seq.request_id], logits[row], chain[r], greedy[row])
            streams = streams.clone()
            streams[idx] = out
        for slot, first, rows in saved:
            self.cache.put_rows(slot, first, rows)

    @staticmethod
    def _take(draft: Draft, logits: torch.Tensor, work: MTPWork, argmax: int) -> None:
        """The request's next draft token: the argmax, or for a sampled request a draw from the
        filtered MTP distribution at its next uniform (kept for the acceptance)."""
        p = work.seq.params
        if p.temperature == 0:
            draft.tokens.append(argmax)
            return
        q = filtered_probs(logits, p)
        u = work.uniforms[len(draft.tokens):len(draft.tokens) + 1].to(q.device)
        draft.tokens.append(int(draw_with_uniforms(q[None], u)))
        draft.probs.append(q)
