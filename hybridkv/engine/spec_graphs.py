"""CUDA graphs of the speculative step (engine/speculative.py): the verify forward, the rollback of
rejected positions and the MTP pass, each captured once per (padded batch, draft length k, context
bucket) and replayed.

Run eagerly, a speculative step on the GPU is hundreds of small launches twice over (the verify
forward, then the MTP block) plus the checkpoint and rollback copies, request by request: on the
H200 it decoded 7-12x slower than plain decoding replayed from `DecodeGraphs`. Here a step of B
greedy requests, each verifying k drafts, is three replays and two reads of the host:

1. verify (`_verify_forward`): the k+1 rows of every request as k+1 decode waves (row j·Bp + b is
   request b's j-th token; each wave is one plain decode step's attention over the paged kernels,
   `PagedDecodeKV.fixed` at positions n_b + j), the LM head over every row, and on the device each
   row's argmax and its log-probability. Before the forward it copies the window-ring rows that
   positions n..n+k overwrite; before each wave's compressor update, the compressor states (so the
   state after any number of kept positions is at hand). The host then reads the argmaxes, accepts
   drafts as `speculative.accept` does for greedy requests, and emits the tokens.
2. rollback (`_rollback_forward`), only where some request kept fewer than k+1 positions: the
   rejected positions' ring rows are written back and each compressor state is set to the one
   before the first rejected wave. Entries that rejected tokens completed are left in place: no
   query reads entry j before the token that completes it has run again, and that token's layer
   stores it anew before attending (the compressor runs before the attention). The prefix cache
   registers blocks only up to the kept positions, as on the eager path.
3. MTP (`_mtp_forward`): the MTP block over positions n..n+k as k+1 decode waves over its window
   ring (`MTPDecodeKV`; rows past a request's kept ones run but write nothing), draft 1 from each
   request's last kept row, drafts 2..k chained one position on (their ring rows put back after),
   all argmaxes on the device.

Padding rows (the batch is padded to a power of two) decode token 0 at position 0 in every wave, in
the slot `DecodeGraphs` would reserve: no compressed block completes there.

Taken where every request of the step verifies k greedy drafts (no logprobs asked) past its prefix
hit's frozen blocks with a complete window, and no block boundary whose window-state snapshot the
prefix cache keeps falls inside the verified positions (the state there is not kept; a boundary at
the last kept position is snapshotted after the rollback). Other steps run eagerly. With
capture=False the same fixed-shape functions run eagerly: what the CPU tests check against plain
decoding.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore, SeqCache, _window_complete
from hybridkv.engine.graphs import _copy_in, context_bucket, max_graph_batch, padded_batch
from hybridkv.model.state import DecodeGroup, ForwardBatch


class _VerifyWaveKV(PagedDecodeKV):
    """One verify wave over the paged kernels (`PagedDecodeKV.fixed`) that copies the compressor
    states before its update into `snapshots[(layer, kind)]`, one entry per wave in wave order."""

    snapshots: dict

    def record_compressor_rows(self, layer_id: int, kind: str, kv: torch.Tensor, score: torch.Tensor) -> None:
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
        # listed as a one-token segment lists them: from max(0, pos − W + 1) on, oldest first
        pos = self.positions.unsqueeze(1)
        window_pos = (pos - W + 1).clamp(min=0) + torch.arange(W, device=rows.device)
        keys = ring[self.slots.unsqueeze(1), window_pos % W]
        return keys, (window_pos >= self.start.unsqueeze(1)) & (window_pos <= pos)

    def done(self, layer_id: int) -> None:
        pass


@dataclass
class SpecGraph:
    """The buffers and graphs of one (padded batch, k, context bucket). `inputs` [Bp, 2(k+1) + 1 +
    width] long: each row's k+1 tokens, its k+1 positions, its slot, its block table. `accepted`
    [Bp, k+3] long: the tokens at positions n+1..n+m (0 after), m (positions kept, 1..k+1) and the
    request's first MTP position. `out`: what the forwards leave (device tensors the replays refill)."""

    k: int
    batch: int
    cap: int
    inputs: torch.Tensor
    accepted: torch.Tensor
    graphs: dict = field(default_factory=dict)     # "verify", "rollback", "mtp" -> CUDAGraph
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
        W = self.store.config.sliding_window
        return 0 < len(seqs) <= self.max_batch and all(_window_complete(s, p, W) for s, p in zip(seqs, positions))

    # ----- the three steps -----
    def verify(self, tokens: list[list[int]], seqs: list[SeqCache], positions: list[int]) -> SpecGraph:
        """Run the verify forward of requests seqs[b] feeding tokens[b] (k+1 each) at positions[b]..;
        its results are in the returned graph's `out` until the next verify."""
        k = len(tokens[0]) - 1
        cap = context_bucket(max(positions) + k, self.store.block_tokens)
        key = (padded_batch(len(seqs)), k, cap)
        host = self._host_inputs(tokens, seqs, positions, key[0], cap)
        g = self.graphs.get(key)
        if g is None:
            g = self._build(host, k, cap)
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            _copy_in(g.inputs, host)
        self._launch(g, "verify", self._verify_forward)
        return g

    @staticmethod
    def targets(g: SpecGraph, n: int) -> tuple[list[list[int]], list[list[float]]]:
        """Each request's argmax at each of its k+1 rows and that token's log-probability (one read)."""
        both = torch.cat([g.out["targets"][:, :n].double(), g.out["logprobs"][:, :n].double()]).t().cpu()
        return both[:, :g.k + 1].long().tolist(), both[:, g.k + 1:].tolist()

    def rollback_and_draft(self, g: SpecGraph, kept: list[list[int]], mtp_starts: list[int]) -> list[list[int]]:
        """Keep len(kept[b]) positions of request b (kept[b]: the tokens it emitted, which follow them),
        undo the rest, and draft k tokens for every request from its last kept position."""
        k1 = g.k + 1
        host = torch.zeros(g.batch, k1 + 2, dtype=torch.long)
        host[:, k1] = k1                            # padding rows keep everything: nothing to undo
        for b, (toks, start) in enumerate(zip(kept, mtp_starts)):
            host[b, :len(toks)] = torch.tensor(toks, dtype=torch.long)
            host[b, k1], host[b, k1 + 1] = len(toks), start
        _copy_in(g.accepted, host)
        if any(len(t) < k1 for t in kept):
            self._launch(g, "rollback", self._rollback_forward)
        self._launch(g, "mtp", self._mtp_forward)
        return g.out["drafts"][:len(kept)].tolist()

    def _launch(self, g: SpecGraph, name: str, forward) -> None:
        graph = g.graphs.get(name)
        if graph is None:
            forward(g)
        else:
            graph.replay()
            self.replays += 1

    # ----- building -----
    def _host_inputs(self, tokens, seqs, positions, batch: int, cap: int) -> torch.Tensor:
        k1 = len(tokens[0])
        width = cap // self.store.block_tokens
        out = np.zeros((batch, 2 * k1 + 1 + width), dtype=np.int64)
        out[:, 2 * k1] = self.pad_slot
        for b, (toks, s, p) in enumerate(zip(tokens, seqs, positions)):
            out[b, :k1] = toks
            out[b, k1:2 * k1] = np.arange(p, p + k1)
            out[b, 2 * k1] = s.slot
            row = s.block_table[:width]
            out[b, 2 * k1 + 1:2 * k1 + 1 + len(row)] = row
        return torch.from_numpy(out)

    def _build(self, host: torch.Tensor, k: int, cap: int) -> SpecGraph:
        dev = self.store.device
        accepted = torch.zeros(host.shape[0], k + 3, dtype=torch.long)
        accepted[:, k + 1] = k + 1
        g = SpecGraph(k, host.shape[0], cap, host.to(dev), accepted.to(dev))
        if not self.capture:
            return g
        # A warm-up of the three forwards compiles the kernels outside the capture; what it changed in
        # the requests' windows, compressor states and MTP rings is put back (the replay runs the step
        # again; entries it rewrites get the same values).
        slots = sorted(set(host[:, 2 * (k + 1)].tolist()))
        saved = {(s, i): self.store.capture_state(s, i) for s in slots for i in range(self.store.num_layers)}
        mtp_rows = {s: self.mtp.ring[s].clone() for s in slots}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for forward in (self._verify_forward, self._rollback_forward, self._mtp_forward):
                forward(g)
        torch.cuda.current_stream().wait_stream(side)
        for (s, i), tensors in saved.items():
            self.store.restore_state(s, i, tensors)
        for s, rows in mtp_rows.items():
            self.mtp.ring[s].copy_(rows)
        try:
            for name, forward in (("verify", self._verify_forward), ("rollback", self._rollback_forward),
                                  ("mtp", self._mtp_forward)):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                    forward(g)
                g.graphs[name] = graph
        except RuntimeError as e:
            raise RuntimeError(f"capturing the speculative step (batch {g.batch}, k {k}, {cap} positions) failed: "
                               f"{e}; HYBRIDKV_CUDA_GRAPHS=0 runs speculative steps eagerly") from e
        self.captures += 1
        return g

    # ----- the fixed-shape forwards -----
    def _columns(self, g: SpecGraph):
        k1 = g.k + 1
        inp = g.inputs
        return inp[:, :k1], inp[:, k1:2 * k1], inp[:, 2 * k1].contiguous(), inp[:, 2 * k1 + 1:].contiguous()

    def _verify_forward(self, g: SpecGraph) -> None:
        store, k1, bp = self.store, g.k + 1, g.batch
        tokens, positions, slots, tables = self._columns(g)
        W = store.config.sliding_window
        ring_at = positions % W                                                  # [Bp, k+1]
        saved_ring = [store.ring[i][slots.unsqueeze(1), ring_at] for i in range(store.num_layers)]
        snapshots: dict = {}
        waves = []
        for j in range(k1):
            dkv = _VerifyWaveKV.fixed(store, positions[:, j].contiguous(), slots, tables, max_pos=g.cap - 1)
            dkv.snapshots = snapshots
            waves.append(DecodeGroup(torch.arange(j * bp, (j + 1) * bp, device=slots.device), dkv))
        batch = ForwardBatch([], positions.t().reshape(-1), None, static=True, waves=waves)
        with torch.inference_mode():
            h = self.model(tokens.t().reshape(-1), batch)
            logits = self.model.logits(h).view(k1, bp, -1)
            targets = logits.argmax(-1)                                          # the first maximum, as `accept`
            logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        g.out.update(hidden=h, logits=logits, targets=targets, logprobs=logprobs)
        g.saved.update(ring=saved_ring, ring_at=ring_at, slots=slots, states=snapshots)

    def _rollback_forward(self, g: SpecGraph) -> None:
        store, k1 = self.store, g.k + 1
        s = g.saved
        slots, ring_at = s["slots"], s["ring_at"]
        kept = g.accepted[:, k1]
        keep = torch.arange(k1, device=kept.device).unsqueeze(0) < kept.unsqueeze(1)       # [Bp, k+1]
        with torch.inference_mode():
            for i in range(store.num_layers):
                ring = store.ring[i]
                now = ring[slots.unsqueeze(1), ring_at]
                mask = keep.view(*keep.shape, *([1] * (now.dim() - 2)))
                ring[slots.unsqueeze(1), ring_at] = torch.where(mask, now, s["ring"][i])
            rows = torch.arange(g.batch, device=kept.device)
            for (i, kind), snaps in s["states"].items():
                st_kv, st_score = store.states[i][kind]
                # before wave m: the state after m kept positions (m = k + 1: the state now)
                kv = torch.stack([x[0] for x in snaps] + [st_kv[slots]])[kept, rows]
                score = torch.stack([x[1] for x in snaps] + [st_score[slots]])[kept, rows]
                st_kv[slots] = kv
                st_score[slots] = score

    def _mtp_forward(self, g: SpecGraph) -> None:
        model, cache, k1, bp = self.model, self.mtp, g.k + 1, g.batch
        _, positions, slots, _ = self._columns(g)
        following, kept, start = g.accepted[:, :k1], g.accepted[:, k1], g.accepted[:, k1 + 1]
        dev = slots.device
        waves = [DecodeGroup(torch.arange(j * bp, (j + 1) * bp, device=dev),
                             MTPDecodeKV(cache, positions[:, j].contiguous(), slots, start, write=kept > j))
                 for j in range(k1)]
        batch = ForwardBatch([], positions.t().reshape(-1), None, static=True, waves=waves)
        with torch.inference_mode():
            out = model.mtp_forward(g.out["hidden"], following.t().reshape(-1), batch)
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
                                                          MTPDecodeKV(cache, pos, slots, start))])
                    stream = model.mtp_forward(stream, draft, one)
                    draft = model.mtp_logits(stream).argmax(-1)
                    drafts.append(draft)
                cache.ring[slots.unsqueeze(1), at] = saved
        g.out["drafts"] = torch.stack(drafts, 1)
