"""CUDA graphs of the speculative step (engine/speculative.py): the verify forward, the greedy
acceptance, the rollback of rejected positions and the MTP pass, captured as one graph per (padded
batch, draft length k, context bucket) and replayed.

Run eagerly, a speculative step on the GPU is hundreds of small launches twice over (the verify
forward, then the MTP block) plus the checkpoint and rollback copies, request by request: on the
H200 it decoded 7-12x slower than plain decoding replayed from `DecodeGraphs`. Here a step of B
greedy requests, each verifying k drafts, is one replay and one read of the host:

1. verify (`_verify`): the k+1 rows of every request as k+1 decode waves (row j·Bp + b is request
   b's j-th token, so a wave's rows are one span, read as views; each wave is one plain decode
   step's attention over the paged kernels, `PagedDecodeKV.fixed` at positions n_b + j), the LM head over every row, each row's argmax and
   its log-probability. Before the forward it copies the window-ring rows that positions n..n+k
   overwrite; before the compressor update of each wave after the first, the compressor states (so
   the state after any number of kept positions is at hand). The compressors update as in plain
   decode (one fused launch each on the GPU).
2. acceptance on the device, as `speculative.accept` does for greedy requests: a request keeps its
   drafts while each equals the argmax of the row before it, then the argmax after the last kept
   one; m = accepted + 1 positions are kept. The tokens that follow the kept positions are the
   argmaxes themselves (an accepted draft equals its row's argmax).
3. rollback (`_rollback`): the rejected positions' ring rows are written back and each compressor
   state is set to the one before the first rejected wave. Entries that rejected tokens completed
   are left in place: no query reads entry j before the token that completes it has run again, and
   that token's layer stores it anew before attending (the compressor runs before the attention).
4. MTP (`_draft`): the MTP block over positions n..n+k as k+1 decode waves over its window ring
   (`MTPDecodeKV`; rows past a request's kept ones run but write nothing), draft 1 from each
   request's last kept row, drafts 2..k chained one position on (their ring rows put back after),
   all argmaxes on the device.

The host then reads each request's argmaxes, log-probabilities and next drafts at once, emits the
kept tokens and does the bookkeeping (blocks of rejected positions back to the pool, the prefix cache
registering blocks up to the kept positions). Where it emits fewer tokens than the device kept (an
EOS, a stop string, max_tokens), the request ends with them, so what the device kept past them is
never read.

Padding rows (the batch is padded to a power of two) decode token 0 at position 0 in every wave, in
the slot `DecodeGraphs` would reserve: no compressed block completes there.

Taken where every request of the step verifies k greedy drafts (no logprobs asked) past its prefix
hit's frozen blocks with a complete window, and no block boundary whose window-state snapshot the
prefix cache keeps falls inside the verified positions (the state there is not kept; a boundary at
the last kept position is snapshotted after the step). Other steps run eagerly. With capture=False
the same fixed-shape forward runs eagerly: what the CPU tests check against plain decoding.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore, SeqCache, window_listing
from hybridkv.engine.graphs import (_copy_in, context_bucket, max_graph_batch, padded_batch, warm_up_and_capture,
                                    windows_complete)
from hybridkv.model.state import DecodeGroup, ForwardBatch


class _VerifyWaveKV(PagedDecodeKV):
    """Verify wave `wave` over the paged kernels (`PagedDecodeKV.fixed`). From the second wave on it
    copies the compressor states before its update into `snapshots[(layer, kind)]` (wave j's copy:
    the state after j kept positions), in wave order. Its compressors update in one launch each where
    plain decode's do (`Attention._fused_compressors`): the rollback restores states from the copies,
    not by replaying rows."""

    snapshots: dict
    wave: int
    fuse_compressors = True

    def record_compressor_rows(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None:
        if self.wave:
            self.snapshots.setdefault((layer_id, kind), []).append(self.compressor_state(layer_id, kind))


class MTPDecodeKV:
    """The MTP layer's window ring (`speculative.MTPCache`) as a `DecodeKV` with fixed shapes: rows
    at `positions` [B] of `slots` [B], valid from `start` [B] (each request's first MTP position);
    where `write` [B] is False a row attends as usual but leaves the ring as it was."""

    capture = None

    def __init__(self, cache, positions: torch.Tensor, slots: torch.Tensor, start: torch.Tensor,
                 write: torch.Tensor | None = None):
        self.cache, self.positions, self.slots, self.start, self.write = cache, positions, slots, start, write

    def window(self, layer_id: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ring, W = self.cache.ring, self.cache.window
        at = self.positions % W
        new = rows.to(ring.dtype)
        if self.write is not None:
            new = torch.where(self.write.unsqueeze(1), new, ring[self.slots, at])
        ring[self.slots, at] = new
        listed, valid = window_listing(self.positions, W, self.start)
        return ring[self.slots.unsqueeze(1), listed], valid

    def done(self, layer_id: int) -> None:
        pass


@dataclass
class SpecGraph:
    """The buffers and graph of one (padded batch, k, context bucket). `inputs` [Bp, 2(k+1) + 2 + width]
    long: each row's k+1 tokens, its k+1 positions, its slot, its first MTP position, its block table.
    `out`: what the forward leaves (device tensors each replay refills)."""

    k: int
    batch: int
    cap: int
    inputs: torch.Tensor
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

    def eligible(self, seqs: list[SeqCache], positions: list[int]) -> bool:
        return windows_complete(self.store, self.max_batch, seqs, positions)

    def step(self, tokens: list[list[int]], seqs: list[SeqCache], positions: list[int],
             mtp_starts: list[int]) -> SpecGraph:
        """The speculative step of requests seqs[b] feeding tokens[b] (its last token and k drafts) at
        positions[b].., their MTP windows valid from mtp_starts[b]; read its results with `results`."""
        k = len(tokens[0]) - 1
        cap = context_bucket(max(positions) + k, self.store.block_tokens)
        key = (padded_batch(len(seqs)), k, cap)
        host = self._host_inputs(tokens, seqs, positions, mtp_starts, key[0], cap)
        g = self.graphs.get(key)
        if g is None:
            g = self._build(host, k, cap)
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            _copy_in(g.inputs, host)
        if g.graph is None:
            self._forward(g)
        else:
            g.graph.replay()
            self.replays += 1
        return g

    @staticmethod
    def results(g: SpecGraph, n: int) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """For each of the first n requests: the argmax of each of its k+1 rows, that token's
        log-probability, and its k drafts for the next step (one read)."""
        k1 = g.k + 1
        both = torch.cat([g.out["targets"][:, :n].double(), g.out["logprobs"][:, :n].double(),
                          g.out["drafts"][:n].t().double()]).t().cpu()
        return both[:, :k1].long().tolist(), both[:, k1:2 * k1].tolist(), both[:, 2 * k1:].long().tolist()

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

    def _build(self, host: torch.Tensor, k: int, cap: int) -> SpecGraph:
        g = SpecGraph(k, host.shape[0], cap, host.to(self.store.device))
        if not self.capture:
            return g
        slots = sorted(set(host[:, 2 * (k + 1)].tolist()))
        graph, _ = warm_up_and_capture(lambda: self._forward(g), self.store, slots, self.mempool,
                                       f"the speculative step (batch {g.batch}, k {k}, {cap} positions)",
                                       also=[self.mtp.ring[s] for s in slots])
        g.graph = graph
        self.captures += 1
        return g

    # ----- the fixed-shape forward -----
    def _forward(self, g: SpecGraph) -> None:
        k1 = g.k + 1
        inp = g.inputs
        tokens, positions = inp[:, :k1], inp[:, k1:2 * k1]
        slots, mtp_start, tables = (inp[:, 2 * k1].contiguous(), inp[:, 2 * k1 + 1].contiguous(),
                                    inp[:, 2 * k1 + 2:].contiguous())
        with torch.inference_mode():
            targets = self._verify(g, tokens, positions, slots, tables)            # [k+1, Bp]
            agree = (tokens[:, 1:] == targets[:-1].t()).long().cumprod(1)          # drafts kept while all agree
            kept = agree.sum(1) + 1                                                # [Bp] positions kept, 1..k+1
            self._rollback(g, kept, positions, slots)
            self._draft(g, targets, kept, positions, slots, mtp_start)

    def _verify(self, g: SpecGraph, tokens, positions, slots, tables) -> torch.Tensor:
        store, k1, bp = self.store, g.k + 1, g.batch
        ring_at = positions % store.config.sliding_window                      # [Bp, k+1]
        g.saved["ring"] = [store.ring[i][slots.unsqueeze(1), ring_at] for i in range(store.num_layers)]
        snapshots: dict = {}
        waves = []
        for j in range(k1):
            dkv = _VerifyWaveKV.fixed(store, positions[:, j].contiguous(), slots, tables, max_pos=g.cap - 1)
            dkv.snapshots, dkv.wave = snapshots, j
            waves.append(DecodeGroup(torch.arange(j * bp, (j + 1) * bp, device=slots.device), dkv,
                                     span=(j * bp, (j + 1) * bp)))
        batch = ForwardBatch([], positions.t().reshape(-1), None, static=True, waves=waves)
        h = self.model(tokens.t().reshape(-1), batch)
        logits = self.model.logits(h).view(k1, bp, -1)
        targets = logits.argmax(-1)                                              # the first maximum, as `accept`
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        g.out.update(hidden=h, logits=logits, targets=targets, logprobs=logprobs)
        g.saved["states"] = snapshots
        return targets

    def _rollback(self, g: SpecGraph, kept, positions, slots) -> None:
        store, k1 = self.store, g.k + 1
        ring_at = positions % store.config.sliding_window
        keep = torch.arange(k1, device=kept.device).unsqueeze(0) < kept.unsqueeze(1)       # [Bp, k+1]
        for i in range(store.num_layers):
            ring = store.ring[i]
            now = ring[slots.unsqueeze(1), ring_at]
            mask = keep.view(*keep.shape, *([1] * (now.dim() - 2)))
            ring[slots.unsqueeze(1), ring_at] = torch.where(mask, now, g.saved["ring"][i])
        rows, pick = torch.arange(g.batch, device=kept.device), kept - 1
        for (i, kind), snaps in g.saved["states"].items():
            st_kv, st_score = store.states[i][kind]
            # copied before wave m: the state after m kept positions (m = k + 1: the state now)
            kv = torch.stack([x[0] for x in snaps] + [st_kv[slots]])[pick, rows]
            score = torch.stack([x[1] for x in snaps] + [st_score[slots]])[pick, rows]
            st_kv[slots] = kv
            st_score[slots] = score

    def _draft(self, g: SpecGraph, targets, kept, positions, slots, mtp_start) -> None:
        model, cache, k1, bp = self.model, self.mtp, g.k + 1, g.batch
        dev = slots.device
        waves = [DecodeGroup(torch.arange(j * bp, (j + 1) * bp, device=dev),
                             MTPDecodeKV(cache, positions[:, j].contiguous(), slots, mtp_start, write=kept > j),
                             span=(j * bp, (j + 1) * bp))
                 for j in range(k1)]
        batch = ForwardBatch([], positions.t().reshape(-1), None, static=True, waves=waves)
        # the token after each kept position is that row's argmax
        out = model.mtp_forward(g.out["hidden"], targets.reshape(-1), batch)
        stream = out[(kept - 1) * bp + torch.arange(bp, device=dev)]
        draft = model.mtp_logits(stream).argmax(-1)
        drafts = [draft]
        if g.k > 1:
            # the chain runs on from position n + m, on its own stream and draft; its ring rows are
            # speculative and put back after
            first = positions[:, 0] + kept
            at = (first.unsqueeze(1) + torch.arange(g.k - 1, device=dev)) % cache.window
            saved = cache.ring[slots.unsqueeze(1), at]
            for j in range(g.k - 1):
                pos = first + j
                one = ForwardBatch([], pos, None, static=True,
                                   waves=[DecodeGroup(torch.arange(bp, device=dev),
                                                      MTPDecodeKV(cache, pos, slots, mtp_start), span=(0, bp))])
                stream = model.mtp_forward(stream, draft, one)
                draft = model.mtp_logits(stream).argmax(-1)
                drafts.append(draft)
            cache.ring[slots.unsqueeze(1), at] = saved
        g.out["drafts"] = torch.stack(drafts, 1)
