"""CUDA graphs of the speculative step (engine/speculative.py): the verify forward, the
acceptance, the rollback of rejected positions and the MTP pass, captured as one graph per (padded
batch, draft length k, context bucket, whether any request samples) and replayed.

Run eagerly, a speculative step on the GPU is hundreds of small launches twice over (the verify
forward, then the MTP block) plus the checkpoint and rollback copies, request by request: on the
H200 it decoded 7-12x slower than plain decoding replayed from `DecodeGraphs`. Here a step of B
requests, each verifying k drafts, is one replay and one read of the host:

1. verify (`_verify`): the k+1 rows of every request as k+1 decode waves (row j·Bp + b is request
   b's j-th token, so a wave's rows are one span, read as views; wave j is `PagedDecodeKV.fixed` at
   positions n_b + j, and each row attends as a plain decode row there: the compressors update wave
   after wave, then one indexer and one attention launch serve every wave, `Attention._attend_waves`),
   the LM head over every row, each row's argmax and its log-probability. Before the forward it copies the window-ring rows that positions n..n+k
   overwrite; before the compressor update of each wave after the first, the compressor states (so
   the state after any number of kept positions is at hand). The compressors update as in plain
   decode (one fused launch each on the GPU).
2. acceptance on the device (`_accept`), as `speculative.accept` decides: a greedy request keeps its
   drafts while each equals the argmax of the row before it, then takes the argmax after the last
   kept one; a sampled one accepts draft i with probability min(1, p(d)/q(d)) (p: the main model's
   filtered distribution at the row before it, q: the draft's, kept in `draft_probs` by the MTP pass
   that drew it) and at the first rejection draws from max(p − q, 0), after k acceptances from p.
   m = accepted + 1 positions are kept. Randomness comes from uniforms drawn before each replay by
   the device's default generator, tokens by inverting cumulative weights (`draw_with_uniforms`);
   the filters run on every row without branching on their parameters (`filtered_probs_fixed`).
3. rollback (`_rollback`): the rejected positions' ring rows are written back and each compressor
   state is set to the one before the first rejected wave, the layers' states of one shape
   (`PagedKVStore.state_groups`) in one gather and one scatter. Entries that rejected tokens completed
   are left in place: no query reads entry j before the token that completes it has run again, and
   that token's layer stores it anew before attending (the compressor runs before the attention).
4. MTP (`_draft`): the MTP block over positions n..n+k as k+1 decode waves over its window ring
   (`mtp_waves`, every wave's window listed at once by `MTPDecodeKV.wave_window`; rows past a
   request's kept ones run but write nothing), draft 1 from each
   request's last kept row, drafts 2..k chained one position on (their ring rows put back after):
   argmaxes, or for sampled requests draws from the filtered MTP distribution (`_pick`).

The host then reads each request's tokens, log-probabilities, accepted count and next drafts at once,
emits the kept tokens and does the bookkeeping (blocks of rejected positions back to the pool, the
prefix cache registering blocks up to the kept positions). Where it emits fewer tokens than the
device kept (an EOS, a stop string, max_tokens), the request ends with them, so what the device kept
past them is never read.

Padding rows (the batch is padded to a power of two) decode token 0 at position 0 in every wave, in
the slot `DecodeGraphs` would reserve: no compressed block completes there.

Taken where every request of the step verifies k drafts (greedy or sampled; a seeded request's
uniforms come from its own generator in the same call as on the eager path, so its tokens do not
depend on which path its steps take), past its prefix hit's frozen blocks with a complete window.
Other steps run eagerly. A block boundary among the kept positions whose window-state snapshot the
prefix cache keeps is snapshotted after the replay from what the step saved (`boundary_state`: the
ring rows the later positions overwrote, the compressor states before the wave after it); one at the
last kept position from the state then. With capture=False the same fixed-shape forward runs eagerly:
what the CPU tests check against plain decoding.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore, SeqCache
from hybridkv.engine.graphs import (_copy_in, context_bucket, max_graph_batch, padded_batch, warm_up_and_capture,
                                    windows_complete)
from hybridkv.engine.sampling import draw_with_uniforms, filtered_probs_fixed
from hybridkv.engine.speculative import step_uniforms
from hybridkv.model.state import DecodeGroup, ForwardBatch
from hybridkv.ops.ranges import arange
from hybridkv.ops.speculative import accept_greedy, restore_ring_, restore_states_
from hybridkv.ops.sampling import greedy_rows
from hybridkv.ops.window import window_listing


# the most top log-probabilities a request may ask (`SamplingParams.validate`): a graph in which some
# request asks keeps this many for every row, and each request reads its own number
TOP_LOGPROBS = 20


class _VerifyWaveKV(PagedDecodeKV):
    """Verify wave `wave` over the paged kernels (`PagedDecodeKV.fixed`). From the second wave on it
    keeps the compressor states before its update in `snapshots[(layer, kind)]` (wave j's copy: the
    state after j kept positions), in wave order: copied by the compressor's fused launch itself
    (`state_snapshot`), or where the compressor runs as torch operations, before them. The copies
    are views of `copies` (`_StateCopies`: one buffer of each state group, which the rollback reads
    in one launch). Its compressors update in one launch each where plain decode's do
    (`Attention._fused_compressors`), every wave's in the same launch (`wave_compressor_inputs`,
    asked of the first wave): the rollback restores states from the copies, not by replaying rows."""

    snapshots: dict
    copies: "_StateCopies"
    wave: int
    wave_positions: torch.Tensor        # every wave's positions [waves·B], wave after wave
    fuse_compressors = True

    def state_snapshot(self, layer_id: int, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers a fused compressor launch copies this wave's states into before its update
        (None in the first wave, whose states the rollback never needs)."""
        if not self.wave:
            return None
        bufs = self.copies.of(layer_id, kind, self.wave)
        self.snapshots.setdefault((layer_id, kind), []).append(bufs)
        return bufs

    def wave_compressor_inputs(self, layer_id: int, kind: str, waves: int, ratio: int, inv_freq: torch.Tensor,
                               key: object) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor],
                                                     tuple[torch.Tensor, torch.Tensor]]:
        """For one launch that updates a compressor over every wave (this view the first, `waves` of
        them: `compress_decode_paged` with waves): every wave's positions [waves·B], the rotations at
        their block starts (once per ratio and table) and the buffers [waves − 1, B, ...] for the
        states before waves 1.., registered as those waves' copies."""
        if self.wave or waves != self.copies.k + 1:
            raise ValueError(f"a launch over {waves} verify waves from wave {self.wave} of a {self.copies.k + 1}-wave step")
        cache = self.__dict__.setdefault("_wave_rope", {})
        if (ratio, key) not in cache:
            from hybridkv.ops.rope import rope_cos_sin
            cache[(ratio, key)] = rope_cos_sin(self.wave_positions, inv_freq, 1 - ratio, 0)
        g, m = self.copies.where[(layer_id, kind)]
        save = tuple(buf[:, m] for buf in self.copies.buffers[g])
        self.snapshots.setdefault((layer_id, kind), []).extend(zip(*(t.unbind(0) for t in save)))
        return self.wave_positions, cache[(ratio, key)], save

    def record_compressor_rows(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        if self.wave:
            bufs = self.copies.of(layer_id, kind, self.wave)
            for state, buf in zip(self.store.states[layer_id][kind], bufs):
                torch.index_select(state, 0, self.slots, out=buf)
            self.snapshots.setdefault((layer_id, kind), []).append(bufs)


class _StateCopies:
    """The compressor states the verify waves copy before their updates: for each of the store's
    state groups (`PagedKVStore.state_groups`) one kv and one score buffer [k, members, B, ...];
    wave w (1..k) copies member m's rows into [w − 1, m]."""

    def __init__(self, store: PagedKVStore, k: int, batch: int):
        self.k, self.where, self.buffers = k, {}, []
        for g, group in enumerate(store.state_groups):
            self.buffers.append(tuple(torch.empty((k, len(group.members), batch) + t.shape[2:], dtype=t.dtype,
                                                  device=t.device) for t in (group.kv, group.score)))
            self.where.update({member: (g, m) for m, member in enumerate(group.members)})

    def of(self, layer_id: int, kind: str, wave: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, m = self.where[(layer_id, kind)]
        return tuple(buf[wave - 1, m] for buf in self.buffers[g])


class MTPDecodeKV:
    """The MTP layer's window ring (`speculative.MTPCache`) as a `DecodeKV` with fixed shapes: rows
    at `positions` [B] of `slots` [B], valid from `start` [B] (each request's first MTP position);
    where `write` [B] is False a row attends as usual but leaves the ring as it was."""

    capture = None

    def __init__(self, cache, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                 write: torch.Tensor | None = None, listing: tuple[torch.Tensor, torch.Tensor] | None = None,
                 joint: "MTPWaves | None" = None):
        """listing: `window_listing(positions, window, start)` computed beforehand (the verify waves'
        listings in one go: `wave_listings`); joint: every verify wave's layout, on the first wave's
        view (`mtp_waves`)."""
        self.cache, self.positions, self.slots, self.start, self.write = cache, positions, slots, start, write
        self.listing, self.joint = listing, joint

    def window(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ring, W = self.cache.ring, self.cache.window
        at = self.positions % W
        new = rows.to(ring.dtype)
        if self.write is not None:
            new = torch.where(self.write.unsqueeze(1), new, ring[self.slots, at])
        ring[self.slots, at] = new
        listed, valid = self.listing or window_listing(self.positions, W, self.start)
        return ring[self.slots.unsqueeze(1), listed], valid

    def wave_window(self, views: list["MTPDecodeKV"], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`window` of all the verify waves of `mtp_waves` at once (this view first), or None for views
        made otherwise: rows [waves·B, D] wave after wave -> keys [waves·B, window, D] and validity,
        each row's window listed as `window` lists it, its verify positions read from `rows` and the
        earlier ones from the ring; then each wave's rows go into the ring where its `write` allows.
        (A row past a request's kept ones reads the rows before it even where they are not written:
        its output is never used.)"""
        if self.joint is None or len(views) != self.joint.sources.shape[0]:
            return None
        ring, j = self.cache.ring, self.joint
        waves, b = j.sources.shape[:2]
        new = rows.to(ring.dtype).view(waves, b, -1)
        both = torch.cat([ring[self.slots], new.transpose(0, 1)], 1)         # [B, window + waves, D]
        keys = both[j.requests, j.sources]
        slots = self.slots.unsqueeze(0).expand(waves, b)
        ring[slots, j.ring_rows] = torch.where(j.write.unsqueeze(-1), new, ring[slots, j.ring_rows])
        return keys.flatten(0, 1), j.valid.flatten(0, 1)

    def done(self, layer_id: int) -> None:
        pass


@dataclass
class MTPWaves:
    """What `MTPDecodeKV.wave_window` reads, [waves, B, ...] each: `sources` [.., window] where each
    listed window row comes from among a request's ring rows (0..window−1) and then its verify rows
    (window + i: position p_b + i), `valid` [.., window], `ring_rows` where each verify row goes in
    the ring and `write` whether it does; `requests` [1, B, 1] the rows' request indices."""

    sources: torch.Tensor
    valid: torch.Tensor
    ring_rows: torch.Tensor
    write: torch.Tensor
    requests: torch.Tensor


def mtp_waves(cache, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
              kept: torch.Tensor) -> list[MTPDecodeKV]:
    """The MTP block's verify waves: request b's row j at positions[b, j] (= positions[b, 0] + j),
    written into its window ring where j < kept[b]; the first view also lists every wave's window at
    once (`wave_window`)."""
    window, (b, waves) = cache.window, positions.shape
    dev = positions.device
    listed, valid = wave_listings(positions, window, start)
    wave = arange(waves, device=dev)
    # a listed position p ≥ p_b is verify row p − p_b (≤ the wave's own); (p − p_b) mod window is larger for p < p_b
    ahead = (listed - positions[:, :1].unsqueeze(0)) % window
    joint = MTPWaves(torch.where(ahead <= wave.view(-1, 1, 1), ahead + window, listed), valid,
                     (positions % window).t(), wave.unsqueeze(1) < kept.unsqueeze(0),
                     arange(b, device=dev).view(1, b, 1))
    return [MTPDecodeKV(cache, positions[:, j], slots, start, write=joint.write[j],
                        listing=(listed[j], valid[j]), joint=joint if j == 0 else None)
            for j in range(waves)]


def wave_listings(positions: torch.Tensor, window: int, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_listing` of every verify wave at once: positions [B, k+1] -> ring rows and validity
    [k+1, B, window], wave j's as `window_listing(positions[:, j], window, start)` gives them."""
    b, waves = positions.shape
    listed, valid = window_listing(positions.t().reshape(-1), window, start.repeat(waves))
    return listed.view(waves, b, window), valid.view(waves, b, window)


@dataclass
class SpecGraph:
    """The buffers and graph of one (padded batch, k, context bucket). `inputs` [Bp, 2(k+1) + 2 + width]
    long: each row's k+1 tokens, its k+1 positions, its slot, its first MTP position, its block table.
    `out`: what the forward leaves (device tensors each replay refills)."""

    k: int
    batch: int
    cap: int
    inputs: torch.Tensor
    sampled: bool = False
    top: int = 0                             # top log-probabilities kept per row (some request asks)
    params: torch.Tensor | None = None       # sampled: [Bp, 3] float32 temperature, top-k, top-p
    uniforms: torch.Tensor | None = None     # sampled: [Bp, 2k + 1], drawn anew before each replay
    graph: torch.cuda.CUDAGraph | None = None
    out: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)


class SpeculativeGraphs:
    """Captured speculative steps of one engine, least recently used first out beyond `max_graphs`."""

    def __init__(self, model, store: PagedKVStore, mtp_cache, pad_slot: int, capture: bool = True,
                 max_graphs: int = 8):
        self.model, self.store, self.mtp, self.pad_slot = model, store, mtp_cache, pad_slot
        self.capture, self.max_graphs = capture, max_graphs
        self.max_batch = max_graph_batch()
        self.graphs: OrderedDict[tuple[int, int, int], SpecGraph] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.replays = 0
        # sampled requests' draft distributions [slots, k, vocab] float32, by the MTP pass that drew the
        # drafts (its own or the eager drafter's, `put_draft_probs`), read by the next step's acceptance
        self.draft_probs: torch.Tensor | None = None

    def eligible(self, seqs: list[SeqCache], positions: list[int]) -> bool:
        return windows_complete(self.store, self.max_batch, seqs, positions)

    def step(self, tokens: list[list[int]], seqs: list[SeqCache], positions: list[int],
             mtp_starts: list[int], params: list | None = None,
             generators: list[torch.Generator | None] | None = None) -> SpecGraph:
        """The speculative step of requests seqs[b] feeding tokens[b] (its last token and k drafts) at
        positions[b].., their MTP windows valid from mtp_starts[b], sampling under params[b]
        (`SamplingParams`; None: all greedy, no logprobs; a sampled request's draft distributions must
        be in `draft_probs`), a seeded one drawing its uniforms from generators[b] as the eager path
        would (`speculative.step_uniforms`); read its results with `results`."""
        k = len(tokens[0]) - 1
        cap = context_bucket(max(positions) + k, self.store.block_tokens)
        sampled = params is not None and any(p.temperature > 0 for p in params)
        top = TOP_LOGPROBS if params is not None and any(p.logprobs for p in params) else 0
        key = (padded_batch(len(seqs)), k, cap, sampled, top)
        host = self._host_inputs(tokens, seqs, positions, mtp_starts, key[0], cap)
        g = self.graphs.get(key)
        if g is None:
            g = self._build(host, k, cap, self._host_params(params, key[0]) if sampled else None, top)
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            _copy_in(g.inputs, host)
            if sampled:
                _copy_in(g.params, self._host_params(params, key[0]))
        if sampled:
            g.uniforms.uniform_()       # outside the graph: the device's default generator, anew each step
            for b, gen in enumerate(generators or ()):
                if gen is not None:     # a seeded request: its own 2k + 1, as on the eager path
                    g.uniforms[b] = step_uniforms(2 * k + 1, gen, g.uniforms.device)
        if g.graph is None:
            self._forward(g)
        else:
            g.graph.replay()
            self.replays += 1
        return g

    @staticmethod
    def results(g: SpecGraph, n: int) -> tuple[list[list[int]], list[list[float]], list[int], list[list[int]],
                                                list[list[list[tuple[int, float]]]] | None]:
        """For each of the first n requests (one read): the k+1 tokens that follow its verified
        positions (the accepted drafts, then the main model's own token; entries past it unused),
        their log-probabilities, how many drafts it accepted, its k drafts for the next step, and
        where the graph keeps them each row's top log-probabilities as (id, logprob), best first."""
        k1 = g.k + 1
        both = g.out["packed"][:n].cpu()
        out = (both[:, :k1].long().tolist(), both[:, k1:2 * k1].tolist(), both[:, 2 * k1].long().tolist(),
               both[:, 2 * k1 + 1:3 * k1].long().tolist())
        if not g.top:
            return (*out, None)
        width = k1 * g.top
        ids = both[:, 3 * k1:3 * k1 + width].long().view(n, k1, g.top).tolist()
        values = both[:, 3 * k1 + width:].view(n, k1, g.top).tolist()
        return (*out, [[list(zip(i_row, v_row)) for i_row, v_row in zip(i, v)] for i, v in zip(ids, values)])

    def boundary_state(self, g: SpecGraph, row: int, slot: int, start: int, j: int) -> list[list[torch.Tensor]]:
        """Every layer's state after the first j (1..k) of the positions that request `row` (cache
        slot `slot`) verified from `start` in the last replay, as `PagedKVStore.capture_state` lists
        it, for the prefix cache's snapshot at a block boundary inside the kept positions. Read after
        the replay from what it saved: its window ring now with the rows that positions start+j..
        start+k overwrote put back (`saved["ring"]`), and each compressor's state before wave j's
        update (`saved["states"]`; one no wave updated: its state now). Copies, as the next replay
        overwrites the graph's buffers."""
        store, saved = self.store, g.saved["states"]
        at = torch.arange(start + j, start + g.k + 1, device=store.rings.device) % store.config.sliding_window
        out = []
        for layer_id in range(store.num_layers):
            state = store.capture_state(slot, layer_id)          # [ring, then kv, score of each kind]
            state[0][at] = g.saved["ring"][layer_id, row, j:]
            for i, kind in enumerate(store.states[layer_id]):
                if (layer_id, kind) in saved:
                    state[1 + 2 * i], state[2 + 2 * i] = (t[row].clone() for t in saved[(layer_id, kind)][j - 1])
            out.append(state)
        return out

    def put_draft_probs(self, slot: int, probs: list[torch.Tensor]) -> None:
        """A sampled request's draft distributions from the eager drafter, where the next graph reads them."""
        buf = self._draft_buffer(len(probs))
        buf[slot, :len(probs)] = torch.stack(probs).to(buf.device)

    def _draft_buffer(self, k: int) -> torch.Tensor:
        # k is the engine's: the buffer, once graphs read it in place, is never made anew
        if self.draft_probs is None or self.draft_probs.shape[1] < k:
            self.draft_probs = torch.zeros(self.mtp.ring.shape[0], k, self.model.config.vocab_size,
                                           dtype=torch.float32, device=self.store.device)
        return self.draft_probs

    # ----- building -----
    def _host_inputs(self, tokens, seqs, positions, mtp_starts, batch: int, cap: int) -> torch.Tensor:
        k1 = len(tokens[0])
        width = cap // self.store.block_tokens
        out = np.zeros((batch, 2 * k1 + 2 + width), dtype=np.int64)
        out[:, 2 * k1] = self.pad_slot
        for b, (toks, s, p, m) in enumerate(zip(tokens, seqs, positions, mtp_starts)):
            out[b, :k1] = toks
            out[b, k1:2 * k1] = np.arange(p, p + k1)
            out[b, 2 * k1:2 * k1 + 2] = s.slot, m
            row = s.block_table[:width]
            out[b, 2 * k1 + 2:2 * k1 + 2 + len(row)] = row
        return torch.from_numpy(out)

    @staticmethod
    def _host_params(params: list, batch: int) -> torch.Tensor:
        """[batch, 3] float32: each request's temperature, top-k and top-p; padding rows greedy."""
        out = np.zeros((batch, 3), dtype=np.float32)
        out[:, 2] = 1.0
        for b, p in enumerate(params):
            out[b] = (p.temperature, p.top_k, p.top_p)
        return torch.from_numpy(out)

    def _build(self, host: torch.Tensor, k: int, cap: int, params: torch.Tensor | None = None,
               top: int = 0) -> SpecGraph:
        dev = self.store.device
        g = SpecGraph(k, host.shape[0], cap, host.to(dev), top=min(top, self.model.config.vocab_size))
        if params is not None:
            g.sampled, g.params = True, params.to(dev)
            g.uniforms = torch.rand(g.batch, 2 * k + 1, device=dev)
            self._draft_buffer(k)       # before the capture: the graph reads and writes it in place
        if not self.capture:
            return g
        slots = sorted(set(host[:, 2 * (k + 1)].tolist()))
        graph, _ = warm_up_and_capture(lambda: self._forward(g), self.store, slots, self.mempool,
                                       f"the speculative step (batch {g.batch}, k {k}, {cap} positions)",
                                       also=[self.mtp.ring[s] for s in slots]
                                       + ([self.draft_probs[s] for s in slots] if g.sampled else []))
        g.graph = graph
        self.captures += 1
        return g

    # ----- the fixed-shape forward -----
    def _forward(self, g: SpecGraph) -> None:
        k1 = g.k + 1
        inp = g.inputs
        tokens, positions = inp[:, :k1], inp[:, k1:2 * k1]
        flat_positions = positions.t().reshape(-1)            # every wave's, wave after wave
        slots, mtp_start, tables = (inp[:, 2 * k1].contiguous(), inp[:, 2 * k1 + 1].contiguous(),
                                    inp[:, 2 * k1 + 2:].contiguous())
        with torch.inference_mode():
            logits = self._verify(g, tokens, positions, flat_positions, slots, tables)   # [k+1, Bp, vocab]
            kept, following = self._accept(g, logits, tokens, slots)
            self._rollback(g, kept, positions, slots)
            self._draft(g, following, kept, positions, flat_positions, slots, mtp_start)
            # what `results` reads, in one float64 tensor (ids exact below 2^53): one copy to the host
            parts = [g.out["tokens"], g.out["logprobs"], g.out["kept"][:, None] - 1, g.out["drafts"]]
            if g.top:
                parts += [g.out["top_ids"].flatten(1), g.out["top_logprobs"].flatten(1)]
            g.out["packed"] = torch.cat([x.to(torch.float64) for x in parts], 1)

    def _accept(self, g: SpecGraph, logits: torch.Tensor, tokens: torch.Tensor, slots: torch.Tensor):
        """Each request's kept positions [Bp] (1..k+1) and the tokens that follow its k+1 verified
        positions [Bp, k+1] (accepted drafts, then its own token; past that, that token again), as
        `speculative.accept` decides: greedy rows keep drafts while each equals the argmax of the
        row before (where no request samples, in one launch: `accept_greedy`); sampled rows accept
        draft i with probability min(1, p(d)/q(d)) and then draw from the residual max(p − q, 0) at
        the first rejection, else from p, with this step's uniforms."""
        k, bp = g.k, g.batch
        # each row's first maximum and its log-probability (two launches over many programs on the GPU;
        # torch's argmax takes one block a row, tens of microseconds for a 129K vocabulary)
        flat, greedy_lp = greedy_rows(logits.reshape((k + 1) * bp, -1))
        if g.sampled:
            kept, following = self._accept_sampled(g, logits, flat, tokens, slots)
        else:
            kept, following = accept_greedy(flat.view(k + 1, bp), tokens)
        g.out["kept"], g.out["tokens"] = kept, following
        if g.sampled or g.top:
            logprobs = torch.log_softmax(logits, -1).transpose(0, 1)               # [Bp, k+1, vocab]
            g.out["logprobs"] = logprobs.gather(-1, following.unsqueeze(-1)).squeeze(-1)
            if g.top:
                g.out["top_logprobs"], g.out["top_ids"] = torch.topk(logprobs, g.top, -1)
        else:   # greedy: wherever a token is kept it is its row's argmax (an accepted draft equals it)
            g.out["logprobs"] = greedy_lp.view(k + 1, bp).t()
        return kept, following

    def _accept_sampled(self, g: SpecGraph, logits: torch.Tensor, flat: torch.Tensor, tokens: torch.Tensor,
                        slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`_accept`'s kept positions and following tokens where some request samples (greedy ones
        beside them as `accept_greedy` keeps them); flat: every row's argmax, wave after wave."""
        k, bp = g.k, g.batch
        argmax = flat.view(k + 1, bp).t()                                         # [Bp, k+1]
        drafts = tokens[:, 1:]
        temp, top_k, top_p = g.params.unbind(1)
        rows = logits.transpose(0, 1).reshape(bp * (k + 1), -1)
        p = filtered_probs_fixed(rows, *(x.repeat_interleave(k + 1) for x in (temp, top_k, top_p)))
        p = p.view(bp, k + 1, -1)
        q = self.draft_probs[slots, :k]                                           # [Bp, k, vocab]
        p_d = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        sampled = (temp > 0).unsqueeze(1)
        agree = torch.where(sampled, g.uniforms[:, :k] * q_d < p_d, drafts == argmax[:, :-1])
        kept = agree.long().cumprod(1).sum(1) + 1
        at = (kept - 1).unsqueeze(1)                                              # the first unverified draft
        pick = at.unsqueeze(-1).expand(bp, 1, p.shape[-1])
        p_at = p.gather(1, pick).squeeze(1)
        q_at = torch.cat([q, torch.zeros_like(q[:, :1])], 1).gather(1, pick).squeeze(1)   # q past k: 0
        residual = (p_at - q_at).clamp(min=0)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
        own = torch.where(temp > 0, draw_with_uniforms(residual, g.uniforms[:, k]), argmax.gather(1, at).squeeze(1))
        column = arange(k + 1, device=kept.device).unsqueeze(0)
        following = torch.where(column < at, torch.cat([drafts, drafts[:, :1]], 1), own.unsqueeze(1))
        return kept, following

    def _verify(self, g: SpecGraph, tokens, positions, flat_positions, slots, tables) -> torch.Tensor:
        store, k1, bp = self.store, g.k + 1, g.batch
        ring_at = positions % store.config.sliding_window                      # [Bp, k+1]
        g.saved["ring"] = store.rings[:, slots.unsqueeze(1), ring_at]            # [layers, Bp, k+1, E]
        snapshots: dict = {}
        copies = _StateCopies(store, g.k, bp)
        waves = []
        for j in range(k1):
            dkv = _VerifyWaveKV.fixed(store, positions[:, j].contiguous(), slots, tables, max_pos=g.cap - 1,
                                      like=waves[0].kv if waves else None)
            dkv.snapshots, dkv.copies, dkv.wave = snapshots, copies, j
            dkv.wave_positions = flat_positions
            waves.append(DecodeGroup(arange(j * bp, (j + 1) * bp, device=slots.device), dkv,
                                     span=(j * bp, (j + 1) * bp)))
        batch = ForwardBatch([], flat_positions, None, static=True, waves=waves)
        h = self.model(tokens.t().reshape(-1), batch)
        logits = self.model.logits(h).view(k1, bp, -1)
        g.out.update(hidden=h, logits=logits)
        g.saved["states"], g.saved["copies"] = snapshots, copies
        return logits

    def _rollback(self, g: SpecGraph, kept, positions, slots) -> None:
        """The rejected positions' ring rows put back, and each state group's members set to their
        state after the kept positions, from the copies the verify waves took (every compressor
        updates in every wave, so each has k copies)."""
        store = self.store
        restore_ring_(store.rings, g.saved["ring"], slots, positions[:, 0].contiguous(), kept)
        saved, copies = g.saved["states"], g.saved["copies"]
        for group, (kv_copies, score_copies) in zip(store.state_groups, copies.buffers):
            missing = [m for m in group.members if len(saved.get(m, ())) != g.k]
            if missing:
                raise RuntimeError(f"the verify waves copied no states of {missing} before their updates")
            restore_states_(group.kv, group.score, kv_copies, score_copies, slots, kept)

    def _pick(self, g: SpecGraph, logits: torch.Tensor, slots: torch.Tensor, j: int) -> torch.Tensor:
        """Draft j+1 of every request from the MTP block's logits [Bp, vocab]: the argmax, or for a
        sampled request a draw from its filtered distribution, which is kept for the next step."""
        greedy = greedy_rows(logits)[0]
        if not g.sampled:
            return greedy
        temp, top_k, top_p = g.params.unbind(1)
        q = filtered_probs_fixed(logits, temp, top_k, top_p)
        self.draft_probs[slots, j] = q
        return torch.where(temp > 0, draw_with_uniforms(q, g.uniforms[:, g.k + 1 + j]), greedy)

    def _draft(self, g: SpecGraph, following, kept, positions, flat_positions, slots, mtp_start) -> None:
        model, cache, k1, bp = self.model, self.mtp, g.k + 1, g.batch
        dev = slots.device
        waves = [DecodeGroup(arange(j * bp, (j + 1) * bp, device=dev), view, span=(j * bp, (j + 1) * bp))
                 for j, view in enumerate(mtp_waves(cache, positions, slots, mtp_start, kept))]
        batch = ForwardBatch([], flat_positions, None, static=True, waves=waves)
        out = model.mtp_forward(g.out["hidden"], following.t().reshape(-1), batch)
        stream = out[(kept - 1) * bp + arange(bp, device=dev)]
        draft = self._pick(g, model.mtp_logits(stream), slots, 0)
        drafts = [draft]
        if g.k > 1:
            # the chain runs on from position n + m, on its own stream and draft; its ring rows are
            # speculative and put back after
            first = positions[:, 0] + kept
            at = (first.unsqueeze(1) + arange(g.k - 1, device=dev)) % cache.window
            saved = cache.ring[slots.unsqueeze(1), at]
            for j in range(g.k - 1):
                pos = first + j
                one = ForwardBatch([], pos, None, static=True,
                                   waves=[DecodeGroup(arange(bp, device=dev),
                                                      MTPDecodeKV(cache, pos, slots, mtp_start), span=(0, bp))])
                stream = model.mtp_forward(stream, draft, one)
                draft = self._pick(g, model.mtp_logits(stream), slots, j + 1)
                drafts.append(draft)
            cache.ring[slots.unsqueeze(1), at] = saved
        g.out["drafts"] = torch.stack(drafts, 1)
