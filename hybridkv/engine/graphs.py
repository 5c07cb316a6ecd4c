"""CUDA graphs of the engine's batched decode step.

A decode step of a small batch is a few milliseconds of device work behind hundreds of kernel
launches; run eagerly, the host (Python, launches) sets its speed. Here the whole step — the model's
forward over one token per request and the LM head — is captured once per (batch size, context
bucket) and replayed: the host copies the step's inputs (token ids, positions, slots, block tables)
into the graph's buffers and launches one graph.

What makes the forward capturable (`ForwardBatch.static`): no host synchronisation and no shape that
depends on data. The compressors write every request's candidate entry with entry id −1 where no
block completed (`Compressor.update_decode` with a writer), the MoE runs its routed experts without
per-expert token lists (`MoE._routed_static`), and the paged kernels size their grids from the
bucket's largest position instead of the batch's (`context_bucket`): rows past a request's own
position are masked in the kernels, so a longer bucket costs idle programs, not different numbers.

Batch sizes are padded to the next power of two, so a server whose batch changes every few steps
captures at most seven sizes per bucket: padding rows decode token 0 at position 0 in a request slot
reserved for them (no block completes at position 0, and V4.1's ratio-1 layers, where one would,
store nothing there: they store no entry, and they read only their own window row).

Under a memory policy that offloads CSA main entries, each request's device pages (−1: host only)
are inputs too, after its block table: the kernels read and write those layers' entries through
them, and a recall that changes them (`SeqCache.pages_version`) refreshes the buffer before the
next replay.

Taken only where the batched decode runs on the paged kernels (V4, or V4.1 in its packed layout: a
store with kernel formats, the native indexer) and every request's window is complete; other steps
run eagerly. V4.1's Full layers append the entries their tokens
complete with fixed shapes too (`Attention._append_global_kv_decode` on the kernels' path).
Window-state snapshots for the prefix cache are taken after the replay (each layer's state is
final once the step is).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore, SeqCache, _window_complete
from hybridkv.errors import ConfigError
from hybridkv.model.state import DecodeGroup, ForwardBatch
from hybridkv.ops.ranges import arange

MAX_GRAPH_BATCH = 64          # requests a captured decode step holds; HYBRIDKV_GRAPH_BATCH raises it
STEPS_PER_OCTAVE = 8          # context buckets: the next multiple of 2^k / 8 (at most 1/8 idle rows)


def max_graph_batch() -> int:
    """The most requests a decode step replayed from a graph holds: `MAX_GRAPH_BATCH`, or
    `HYBRIDKV_GRAPH_BATCH` (up to 1024). Above 64 the fixed-shape forward makes no host read (tested
    on the CPU) but has not been captured on a GPU yet, hence opt-in."""
    raw = os.environ.get("HYBRIDKV_GRAPH_BATCH")
    if raw is None:
        return MAX_GRAPH_BATCH
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ConfigError(f"HYBRIDKV_GRAPH_BATCH={raw!r}: a request count from 1 to 1024")
    return int(raw)


def context_bucket(max_pos: int, block_tokens: int) -> int:
    """The number of positions a graph is captured for: ≥ max_pos + 1, a multiple of block_tokens,
    at most about 1/8 above it (grids grow with it; each bucket is one capture)."""
    n = max(max_pos + 1, 2 * block_tokens)
    step = max(block_tokens, (1 << (n - 1).bit_length()) // STEPS_PER_OCTAVE)
    return -(-n // step) * step


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None   # None: the fixed-shape forward runs eagerly (capture off)
    inputs: torch.Tensor                 # [B, 3 + width (+ width)] long: token id, position, slot, block table
    #                                      (, device pages in offload mode)
    logits: torch.Tensor | None
    tables: tuple = ()                   # which block tables `inputs` holds (see `_tables_key`)
    extra: dict = field(default_factory=dict)   # the engine's own per-graph state (recorded layer inputs)


def _copy_in(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Host rows into a graph's device buffer without waiting for the device: from pinned memory,
    which the caching host allocator keeps until the copy has run (a copy from pageable memory
    waits for the stream, and so for the step the engine queued before this one)."""
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


def windows_complete(store: PagedKVStore, max_batch: int, seqs: list[SeqCache], positions: list[int]) -> bool:
    """Whether a captured step may serve these requests: at most `max_batch` of them, each with every
    window row its token reads valid (the paged kernels' fixed-shape path)."""
    W = store.config.sliding_window
    return 0 < len(seqs) <= max_batch and all(_window_complete(s, p, W) for s, p in zip(seqs, positions))


def warm_up_and_capture(forward, store: PagedKVStore, slots: list[int], pool, what: str,
                        also: list[torch.Tensor] = ()) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of `forward()` and what its capture returned. A warm-up call on a side stream first
    compiles the kernels and builds the weight caches outside the capture; it runs the very step the
    graph will, so the windows and compressor states of `slots` (and the tensors in `also`) are put
    back after it: the replay runs the step again, and ring rows and entries it rewrites get the
    same values."""
    saved = {(s, i): store.capture_state(s, i) for s in slots for i in range(store.num_layers)}
    copies = [t.clone() for t in also]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    for (s, i), tensors in saved.items():
        store.restore_state(s, i, tensors)
    for t, c in zip(also, copies):
        t.copy_(c)
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the prefix cache's writer thread may copy snapshots to the host meanwhile
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = forward()
    except RuntimeError as e:
        raise RuntimeError(f"capturing {what} failed: {e}; HYBRIDKV_CUDA_GRAPHS=0 runs it eagerly") from e
    return graph, out


def padded_batch(n: int) -> int:
    """The batch size a graph is captured for: the next power of two."""
    return 1 << (n - 1).bit_length()


def _tables_key(seqs: list[SeqCache]) -> tuple:
    """Identifies the rows' block tables (and device pages): during decode a table only grows (a
    block every block_tokens positions) and pages change with a version count, so the device copy is
    refreshed only when this changes. The key holds the lists themselves (compared by identity in
    `_changed_rows`), so none can be freed and another take its address while a graph remembers it."""
    return tuple((s.block_table, len(s.block_table), s.pages, s.pages_version) for s in seqs)


def _changed_rows(old: tuple, new: tuple) -> list[int]:
    """The rows whose block table or pages differ between two `_tables_key`s (a row only one of
    them has: a request that joined, or left its row to the padding)."""
    changed = [i for i, ((x, n, p, v), (y, m, q, w)) in enumerate(zip(old, new))
               if not (x is y and n == m and p is q and v == w)]
    return changed + list(range(min(len(old), len(new)), max(len(old), len(new))))


class DecodeGraphs:
    """Captured decode steps of one engine, keyed by (padded batch size, context bucket), least
    recently used first out beyond `max_graphs`. Takes one request slot of the store for its padding
    rows (the engine sizes its store for that). With capture=False the same fixed-shape forward runs
    eagerly (what the CPU tests check against the engine's own decode path)."""

    def __init__(self, model, store: PagedKVStore, capture: bool = True, max_graphs: int = 16):
        self.model, self.store, self.capture, self.max_graphs = model, store, capture, max_graphs
        self.max_batch = max_graph_batch()     # read once: a bad HYBRIDKV_GRAPH_BATCH fails the engine's start
        self.pad_slot = store.new_seq().slot
        self.graphs: OrderedDict[tuple[int, int], _Graph] = OrderedDict()
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0
        self.replays = 0
        self.last: _Graph | None = None      # the graph of the latest `run`

    @staticmethod
    def supported(model, store: PagedKVStore, indexer_mode: str) -> bool:
        """Whether this engine's batched decode runs on the paged kernels at all (V4; V4.1 in its
        packed layout, whose decode attention and indexer scoring the kernels run)."""
        return model.config.family in ("v4", "v4.1") and store.kernel_formats is not None and indexer_mode == "native"

    def eligible(self, seqs: list[SeqCache], positions: list[int]) -> bool:
        return windows_complete(self.store, self.max_batch, seqs, positions)

    def run(self, ids: list[int] | torch.Tensor, seqs: list[SeqCache], positions: list[int]) -> torch.Tensor:
        """Logits [B, vocab] (float32) of one decode step: token ids[b] of request seqs[b] at positions[b].
        `ids` may be a tensor [B] on the device (the previous step's draws): then the host neither
        reads nor waits for them, and the step queues behind the one that draws them."""
        cap = context_bucket(max(positions), self.store.block_tokens)
        n = len(seqs)
        key = (padded_batch(n), cap)
        on_device = isinstance(ids, torch.Tensor)
        heads = [[t, p, s.slot] for t, p, s in zip([0] * n if on_device else ids, positions, seqs)]
        heads = torch.tensor(heads + [[0, 0, self.pad_slot]] * (key[0] - n), dtype=torch.long)
        tables = _tables_key(seqs)
        g = self.graphs.get(key)
        if g is None:
            g = self._build(self._host_inputs(heads, seqs, cap), cap)
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            changed = _changed_rows(g.tables, tables)
            if 2 * len(changed) > key[0]:
                _copy_in(g.inputs, self._host_inputs(heads, seqs, cap))
            else:      # most steps: only ids, positions and slots, and the tables of a few requests
                _copy_in(g.inputs[:, :3], heads)
                if changed:     # (requests at their own positions open blocks at different steps)
                    rows = self._host_inputs(heads[changed], [seqs[i] if i < n else None for i in changed], cap)
                    index = torch.tensor(changed)
                    if g.inputs.is_cuda:
                        rows, index = (t.pin_memory().to(g.inputs.device, non_blocking=True) for t in (rows, index))
                    g.inputs.index_copy_(0, index, rows)
        if on_device:
            g.inputs[:n, 0].copy_(ids)
        g.tables = tables
        self.last = g
        if g.graph is None:
            return self._forward(g.inputs, cap)[:n]
        g.graph.replay()
        self.replays += 1
        return g.logits[:n].clone()

    def _host_inputs(self, heads: torch.Tensor, seqs: list[SeqCache | None], cap: int) -> torch.Tensor:
        """[rows of `heads`, 3 + width (+ width)]: the heads, then each request's block table (zeros past
        its end and for the padding rows — those past `seqs` or None there — which read no compressed
        entry) and in offload mode its device pages (−1 past its end and for the padding rows)."""
        width = cap // self.store.block_tokens
        tables = np.zeros((heads.shape[0], width), dtype=np.int64)
        pages = np.full((heads.shape[0], width), -1, dtype=np.int64) if self.store.offload else None
        for i, s in enumerate(seqs):     # numpy reads a list of ints several times faster than torch
            if s is None:
                continue
            row = s.block_table[:width]
            tables[i, :len(row)] = row
            if pages is not None:
                row = s.pages[:width]
                pages[i, :len(row)] = row
        return torch.cat([heads, torch.from_numpy(tables)] + ([torch.from_numpy(pages)] if pages is not None else []),
                         dim=1)

    def _build(self, host: torch.Tensor, cap: int) -> _Graph:
        inputs = host.to(self.store.device)
        if not self.capture:
            return _Graph(None, inputs, None)
        graph, logits = warm_up_and_capture(lambda: self._forward(inputs, cap), self.store,
                                            sorted(set(host[:, 2].tolist())), self.mempool,
                                            f"the decode step (batch {host.shape[0]}, {cap} positions)")
        self.captures += 1
        return _Graph(graph, inputs, logits)

    def _forward(self, inputs: torch.Tensor, cap: int) -> torch.Tensor:
        """The decode forward over the buffers' current contents, with fixed shapes."""
        b = inputs.shape[0]
        ids, positions, slots = (inputs[:, i].contiguous() for i in range(3))
        width = cap // self.store.block_tokens
        tables = inputs[:, 3:3 + width].contiguous()
        pages = inputs[:, 3 + width:].contiguous() if self.store.offload else None
        dkv = PagedDecodeKV.fixed(self.store, positions, slots, tables, max_pos=cap - 1, pages=pages)
        batch = ForwardBatch([], positions, DecodeGroup(arange(b, device=inputs.device), dkv, whole=True), static=True)
        with torch.inference_mode():
            return self.model.logits(self.model(ids, batch))
