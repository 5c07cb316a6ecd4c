"""The engine loop: admit requests, schedule a step, run the model over the step's ragged batch,
sample, publish completed blocks and state snapshots to the prefix cache, and report events.

Async scheduling: after a decode step replayed from a CUDA graph, while every running request
decodes and none waits, the next step is queued on the device before the host reads this step's
tokens (`_queue_next`); the following `step` call settles it (`_settle_queued`), queuing the next
behind it first. The host's work therefore overlaps the device's."""

from __future__ import annotations

import copy
import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hybridkv.cache.paged import PagedDecodeKV, PagedKVStore
from hybridkv.cache.prefix import PrefixCache, WindowPolicy, root_hash
from hybridkv.cache.tiers import TieredStore
from hybridkv.cache.tiers.convert import layout_identity
from hybridkv.config import ModelConfig
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.detokenize import release
from hybridkv.engine.graphs import DecodeGraphs
from hybridkv.engine.sampling import Drawn, Sampled, SamplingParams, draw_rows, sample, scored
from hybridkv.engine.scheduler import Chunk, Scheduler, split_segments
from hybridkv.engine.sequence import Sequence, Status
from hybridkv.engine.spec_graphs import SpeculativeGraphs
from hybridkv.engine.speculative import (Draft, MTPCache, MTPDrafter, MTPWork, VerifyCheckpoint, accept,
                                         check_supported, step_uniforms, verify_waves)
from hybridkv.engine.tokenizer import Tokenizer, require
from hybridkv.errors import ConfigError, RequestError
from hybridkv.memory import PolicyContext, parse_policy
from hybridkv.model import ForwardBatch, Transformer
from hybridkv.model.ced import cuts_that_skip
from hybridkv.model.ced import skipped_flops as ced_skipped_flops
from hybridkv.model.state import AttentionCapture
from hybridkv.ops.paged import PagedBatch
from hybridkv.ops.transfer import to_device


log = logging.getLogger(__name__)


@dataclass
class Event:
    """Something a request produced in one step."""

    request_id: str
    token_id: int | None
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    index: int | None = None     # the token's index in the request's output_ids


@dataclass
class _Queued:
    """A decode step queued on the device before the host read the tokens it decodes (async
    scheduling): its input ids are the previous step's draws, still on the device."""

    chunks: list[Chunk]          # one decode chunk per request, in row order
    logits: torch.Tensor         # [B, vocab] on the device
    drawn: Drawn                 # its own tokens, drawn on the device


@dataclass
class _DueScores:
    """The memory indexer's ranking keys of a step's due recalls, on their way to the host."""

    due: list[tuple[str, int]]                # (request id, its complete blocks), in row order
    ranks: torch.Tensor                       # [R, blocks] float64 on the host (pinned on CUDA)
    done: "torch.cuda.Event | None"           # when the copy has landed (None: already there)


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0
    steps: int = 0
    forward_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    pages_loaded: int = 0      # memory policy: resident CSA pages brought to the device
    pages_evicted: int = 0
    pages_written_back: int = 0   # memory policy on the paged kernels: completed blocks' pages copied to host
    graph_steps: int = 0       # decode steps replayed from a CUDA graph (or run by its fixed-shape forward)
    spec_graph_steps: int = 0  # speculative steps replayed from CUDA graphs (or run by their fixed-shape forwards)
    queued_steps: int = 0      # of those, queued before the host read the previous step's tokens (async scheduling)
    spec_drafts: int = 0       # speculative verify steps (requests × steps with at least one draft token)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)   # [i]: drafts accepted at position i
    spec_accepted_hist: list[int] = field(default_factory=list)      # [a]: verify steps that accepted a drafts
    ced_skipped_rows: int = 0   # V4.1 CED prefill: rows the decoder layers skipped (each on every decoder layer)
    ced_skipped_flops: int = 0  # their weight matmul FLOPs (model/ced.py: skipped_flops)


class EngineCore:
    def __init__(self, model: Transformer, tokenizer: Tokenizer | None, model_identity: str,
                 config: EngineConfig | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.config: ModelConfig = model.config
        self.ec = replace(config) if config is not None else EngineConfig()   # a copy: the caller's stays as given
        # V4.1: only the Full (source) layers store compressed KV, read by the layers that share it
        self.v41 = self.config.family == "v4.1"
        self.device = next(model.parameters()).device
        self.memory = parse_policy(self.ec.memory_policy)
        self._set_indexer(self.ec.indexer, self.ec.indexer_seed)
        if self.memory.offloads and self.v41:
            raise ConfigError(f"memory policy {self.memory} moves CSA main entries off the device; V4.1 checkpoints "
                              f"have none (shared global KV): use 'full'")
        if self.ec.enable_prefix_caching is None:
            self.ec = replace(self.ec, enable_prefix_caching=True)
        self._query_x: dict[int, torch.Tensor] = {}     # flashmemory: target layer -> this forward's attention input
        self._query_rows: dict[str, tuple[int, int]] = {}   # request id -> (first row, rows) in this forward
        # flashmemory, requests in prefill: (end position, target layer -> attention inputs of the last
        # ≤ query_rows positions computed), gathered over the prefill's chunks for its first recall
        self._prompt_tail: dict[str, tuple[int, dict[int, torch.Tensor]]] = {}
        # this step's decode recalls: request id -> each complete block's ranking key (`_take_due_scores`)
        self._due_ranks: dict[str, np.ndarray] = {}
        self._step_recalls: list | None = None     # (request, policy context) of the step's recalls, while emitting
        if self.memory.needs_query:
            self._attach_memory_indexer()
        self.speculative = self.ec.speculative is not None
        if self.speculative:
            check_supported(model, self.memory.offloads)
        # with speculation, verify steps replay `SpeculativeGraphs` (plain decode graphs do not hand the
        # streams to the MTP block)
        graphs = (self.ec.cuda_graphs and os.environ.get("HYBRIDKV_CUDA_GRAPHS", "1") != "0"
                  and self.device.type == "cuda")
        # CUDA-graph decode reserves a slot for its padding rows
        self.store = PagedKVStore(self.config, self.ec.num_blocks, self.ec.max_num_seqs + graphs, self.ec.kv_format,
                                  model.dtype, self.device,
                                  (self.ec.resident_pages or self.ec.num_blocks) if self.memory.offloads else None)
        self.policy = WindowPolicy.parse(self.ec.window_policy, self.store.block_tokens)
        self.tiers = (TieredStore.build(self.ec.tiers, layout_identity(self.store, model_identity, self._kv_settings()),
                                        self.device)
                      if self.ec.enable_prefix_caching else None)
        self.prefix = PrefixCache(self.store, self.policy, self.ec.snapshot_bytes, self.ec.enable_prefix_caching,
                                  self.tiers, self.memory.query_rows if self.memory.needs_query else 1)
        self.snapshot_nbytes = sum(self.store.slot_bytes().values())   # one snapshot: every layer's state
        self.scheduler = Scheduler(self.store, self.prefix, self.ec.max_num_seqs, self.ec.max_num_batched_tokens)
        self.model_identity = model_identity
        # a request must fit the KV pool alone (else it would preempt itself, step after step)
        asked = self.ec.max_model_len or self.config.max_position_embeddings
        pool_tokens = self.store.pool.num_blocks * self.store.block_tokens
        self.max_model_len = min(asked, pool_tokens)
        self._length_bound = (f"the KV pool's {pool_tokens} tokens ({self.store.pool.num_blocks} blocks)"
                              if pool_tokens < asked else
                              f"max_model_len {asked}" if self.ec.max_model_len else f"max_position_embeddings {asked}")
        if pool_tokens < asked:
            log.warning("max_model_len is %d, the KV pool's tokens (%d asked): raise num_blocks for longer requests",
                        pool_tokens, asked)
        self.requests: dict[str, Sequence] = {}      # the live ones: a request leaves when it finishes
        # Set to {} to keep finished sequences for inspection (tests, debugging); off by default,
        # since it grows with every request.
        self.finished: dict[str, Sequence] | None = None
        self.stats = EngineStats()
        self.record_logits = False   # keep every sampled row's logits on the sequence (tests, debugging)
        # called with each forward's chunks before it is launched, a queued step's included (a sharded
        # engine checks that every rank scheduled the same, engine/sharded.py)
        self.schedule_check = None
        self.graphs = DecodeGraphs(model, self.store) if graphs and not self.speculative else None
        self.drafter = (MTPDrafter(model, MTPCache(self.config, self.store.max_slots, model.dtype, self.device),
                                   self.device, self.ec.num_speculative_tokens) if self.speculative else None)
        self.spec_graphs = (SpeculativeGraphs(model, self.store, self.drafter.cache, self.store.new_seq().slot)
                            if graphs and self.speculative else None)
        if self.speculative:
            k = self.ec.num_speculative_tokens
            self.stats.spec_accepted_per_pos, self.stats.spec_accepted_hist = [0] * k, [0] * (k + 1)
        self._ids = itertools.count()
        self._queued: _Queued | None = None

    def _set_indexer(self, mode: str, seed: int) -> None:
        from hybridkv.model.csa2 import LatentIndexer
        from hybridkv.model.indexer import Indexer
        indexers = [m for m in self.model.modules() if isinstance(m, (Indexer, LatentIndexer))]
        if mode == "random" and not indexers:
            raise ConfigError("indexer 'random' replaces the Lightning Indexer's top-k (V4's CSA layers, V4.1's "
                              "Full and Reindex layers); this checkpoint has none")
        self._indexer_mode = mode
        for i, ind in enumerate(indexers):
            ind.random_selection = torch.Generator().manual_seed(seed * 1000 + i) if mode == "random" else None

    # ----- requests -----
    def add_request(self, prompt: list[int] | str, params: SamplingParams | None = None,
                    request_id: str | None = None) -> Sequence:
        """Validate and queue a request; raises RequestError naming what is wrong."""
        params = params or SamplingParams()
        params.validate()
        ids = require(self.tokenizer, "a text prompt").encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.stop:
            require(self.tokenizer, "stop strings")
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab}); got {min(ids)}..{max(ids)}")
        max_len = self.max_model_len
        if len(ids) >= max_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this engine takes at most {max_len - 1} "
                               f"({self._length_bound})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise RequestError(f"request id {rid!r} is already in use")
        seq = Sequence(rid, ids, params, root_hash(self.model_identity, params.cache_salt),
                       generator_device=str(self.device))
        self.requests[rid] = seq
        self.scheduler.add(seq)
        self.stats.prompt_tokens += len(ids)
        return seq

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its blocks and slot."""
        seq = self.requests.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def fork(self, request_id: str, n: int = 1, params: SamplingParams | None = None) -> list[Sequence]:
        """n new requests that go on from where a decoding request stands, each in a copy of its cache
        (a slot, blocks and device pages of its own: `PagedKVStore.copy_seq`), as if each had
        prefilled the same prompt and sampled the same tokens. Under the same sampling (greedy, or
        `params` None: the request's own, its random state included) a fork decodes what the request
        decodes. For parallel sampling from one prefill, and for filling the pool with long contexts
        that were prefilled once (benchmarks/flashmemory.py). Raises RequestError, taking nothing, when
        the request cannot be forked now or the engine cannot hold n copies."""
        seq = self.requests.get(request_id)
        if seq is None or seq.status is not Status.RUNNING or seq.in_prefill or not seq.output_ids:
            raise RequestError(f"request {request_id!r} is not decoding: only a running request past its "
                               f"prefill can be forked")
        if self.speculative:
            raise RequestError("fork copies no MTP draft state: not with speculative decoding")
        if self._queued is not None and any(c.seq is seq for c in self._queued.chunks):
            raise RequestError(f"a decode step of {request_id!r} is queued on the device (async scheduling): "
                               f"fork before its decode steps, or with async_scheduling off")
        if seq.cache.recall is not None:
            self._count_recall(self.store.settle_recall(seq.cache, wait=True))
        store, sched = self.store, self.scheduler
        blocks, pages = len(seq.cache.block_table), sum(1 for p in seq.cache.pages if p >= 0)
        room = [("requests", self.ec.max_num_seqs - len(sched.running)), ("slots", store.num_free_slots),
                ("blocks", store.pool.num_free // max(blocks, 1))]
        if store.offload:
            room.append(("device pages", store.page_pool.num_free // max(pages, 1)))
        short = [f"{what} for {left}" for what, left in room if left < n]
        if n < 1 or short:
            raise RequestError(f"cannot fork {request_id!r} {n} times: {'; '.join(short) or 'n must be ≥ 1'} "
                               f"(a copy takes {blocks} blocks{f' and {pages} pages' if store.offload else ''})")
        forks = []
        for _ in range(n):
            rid = f"{request_id}-fork-{next(self._ids)}"
            f = Sequence(rid, list(seq.prompt_ids), replace(params or seq.params), seq.root,
                         token_ids=list(seq.token_ids), status=Status.RUNNING, num_computed=seq.num_computed,
                         cache=store.copy_seq(seq.cache), block_hashes=list(seq.block_hashes),
                         num_cached_tokens=len(seq.prompt_ids), output_ids=list(seq.output_ids),
                         logprobs=list(seq.logprobs), top_logprobs=list(seq.top_logprobs), text=seq.text,
                         decoded=copy.deepcopy(seq.decoded), first_token_time=time.perf_counter(),
                         capture=seq.capture, generator_device=str(self.device))
            if params is None and seq.generator is not None:
                f.generator.set_state(seq.generator.get_state())
            self.requests[rid] = f
            sched.running.append(f)
            self.stats.prompt_tokens += len(f.prompt_ids)
            self.stats.cached_prompt_tokens += len(f.prompt_ids)
            forks.append(f)
        return forks

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Prefix-cache counters per tier (device, dram, disk, redis, writer): hits, bytes stored,
        loaded and evicted, and what each holds now."""
        return self.prefix.stats()

    def tier_usage(self) -> dict[str, dict[str, int | None]]:
        """The prefix-cache tiers below the device (dram, disk, redis; {} without them): bytes
        and entries held, capacity, hits, misses, evictions and expirations of each."""
        return self.tiers.usage() if self.tiers is not None else {}

    def close(self) -> None:
        """Finish the lower tiers' pending writes and release them, and drop the captured decode
        graphs with their memory (idempotent; later steps launch eagerly)."""
        if self.tiers is not None:
            self.tiers.close()
        self.graphs = None
        self._queued = None

    # ----- the step -----
    def _kv_settings(self) -> dict:
        """The settings, away from their defaults, that change the KV this engine computes: engines
        that differ in them never share lower-tier entries (`layout_identity`)."""
        out = {}
        if self.ec.indexer != "native":
            out.update(indexer=self.ec.indexer, indexer_seed=self.ec.indexer_seed)
        if str(self.memory) != "full":
            out["memory_policy"] = str(self.memory)
        return out

    def step(self) -> list[Event]:
        if self._queued is not None:
            events = self._settle_queued()
            if events is not None:
                return events
        chunks = self.scheduler.schedule()
        failed = self._end_unadmitted()
        if self.schedule_check is not None:
            self.schedule_check(chunks)
        if not chunks:
            return failed
        if self.speculative:
            return failed + self._speculative_step(chunks)
        graph_steps = self.stats.graph_steps
        logits = self._forward(chunks)
        for c in chunks:        # offload mode on the paged kernels: completed blocks' pages to host memory
            self.stats.pages_written_back += self.store.write_back(c.seq.cache, c.start, c.start + c.length)
        emitting: list[Sequence] = []
        for c in chunks:
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue
            seq.num_computed = c.start + c.length
            self.prefix.register(seq.root, seq.block_hashes, seq.token_ids, seq.cache, seq.num_computed)
            self._publish_snapshots(seq)
            if c.wants_logits:
                emitting.append(seq)
        events: list[Event] = []
        if emitting:      # every request's token in one sampling pass (one wait for the device)
            rows = torch.stack([logits[seq.request_id] for seq in emitting])
            drawn = draw_rows(rows, [seq.params for seq in emitting], [seq.generator for seq in emitting])
            graphed = self.stats.graph_steps > graph_steps
            if graphed:
                drawn.start_transfer()           # before the recalls' scoring and the next step queue behind it
            scoring = self._start_due_scores(emitting)
            if graphed:
                self._queue_next(emitting, drawn, list(range(len(emitting))))
            self._take_due_scores(scoring)
            events = self._emit_tokens(emitting, rows, drawn.host())
        self.stats.steps += 1
        self.stats.forward_tokens += sum(c.length for c in chunks)
        self._drop_dead_queue()
        return failed + events

    def _end_unadmitted(self) -> list[Event]:
        """End the requests whose admission raised this step, each with its error."""
        events = []
        for seq, why in self.scheduler.unadmitted:
            seq.error = why
            self._finish(seq, "error")
            events.append(Event(seq.request_id, None, finished=True, finish_reason="error"))
        self.scheduler.unadmitted.clear()
        return events

    # ----- async scheduling: the next decode step queued before this one's tokens are read -----
    def _queue_next(self, seqs: list[Sequence], drawn: Drawn, rows: list[int]) -> None:
        """After a decode step replayed from a graph (`seqs` its requests, `rows` their rows of
        `drawn`), queue the next one on the device, its input ids being `drawn`'s tokens there. Only
        where the scheduler would schedule exactly that step: async scheduling on, one decode row of
        every running request, nobody waiting, the pool holding the new positions' blocks without a
        preemption, and the step a graph's. Requests this step's token ends by length are left out;
        those an EOS or a stop string ends are not known yet: their row is dropped when it settles."""
        sched = self.scheduler
        if not (self.ec.async_scheduling and self.graphs is not None
                and not sched.waiting and len(seqs) == len(sched.running)):
            return
        keep = [(seq, r) for seq, r in zip(seqs, rows)
                if seq.status is Status.RUNNING and len(seq.output_ids) + 1 < seq.params.max_tokens
                and seq.num_tokens + 1 < self.max_model_len]
        if not keep or not sched.extend_decodes([seq for seq, _ in keep]):
            return
        if len(keep) == drawn.tokens.shape[0]:
            ids = drawn.tokens
        else:
            index = torch.tensor([r for _, r in keep], dtype=torch.long)
            if drawn.tokens.is_cuda:       # pinned: a copy from pageable memory would wait for the device
                index = index.pin_memory()
            ids = drawn.tokens.index_select(0, index.to(drawn.tokens.device, non_blocking=True))
        chunks = [Chunk(seq, seq.num_computed, 1, [(seq.num_computed, 1)], True) for seq, _ in keep]
        if self.schedule_check is not None:   # a sharded engine's ranks compare every forward, queued ones too
            self.schedule_check(chunks)
        logits = self._graph_decode(chunks, self.policy.snapshots and self.prefix.enabled, ids)
        if logits is None:
            return
        for c in chunks:        # offload mode: completed blocks' pages to host memory, behind the queued step
            self.stats.pages_written_back += self.store.write_back(c.seq.cache, c.start, c.start + 1)
        self.stats.queued_steps += 1
        stacked = torch.stack([logits[c.seq.request_id] for c in chunks])
        queued = draw_rows(stacked, [c.seq.params for c in chunks], [c.seq.generator for c in chunks])
        queued.start_transfer()
        self._queued = _Queued(chunks, stacked, queued)

    def _settle_queued(self) -> list[Event] | None:
        """The queued step's bookkeeping and tokens, with the next step queued behind it first. None
        when every request it decoded for has ended meanwhile (the caller schedules as usual)."""
        q, self._queued = self._queued, None
        live = [i for i, c in enumerate(q.chunks) if c.seq.status is Status.RUNNING]
        if not live:
            return None
        seqs = [q.chunks[i].seq for i in live]
        for i, seq in zip(live, seqs):
            seq.num_computed = q.chunks[i].start + 1
            self.prefix.register(seq.root, seq.block_hashes, seq.token_ids, seq.cache, seq.num_computed)
            self._publish_snapshots(seq)
        scoring = self._start_due_scores(seqs)
        self._queue_next(seqs, q.drawn, live)
        self._take_due_scores(scoring)
        events = self._emit_tokens(seqs, [q.logits[i] for i in live], q.drawn.host(live))
        self.stats.steps += 1
        self.stats.forward_tokens += len(q.chunks)
        self._drop_dead_queue()
        return events

    def _drop_dead_queue(self) -> None:
        """Forget a queued step whose requests all ended with the tokens just emitted."""
        if self._queued is not None and all(c.seq.status is not Status.RUNNING for c in self._queued.chunks):
            self._queued = None

    def _speculative_step(self, chunks: list[Chunk]) -> list[Event]:
        """A step with MTP speculation (engine/speculative.py): verify chunks check their drafts,
        emit the accepted tokens and roll the rest back; then the MTP block runs over what the step
        computed and drafts the next step's tokens."""
        if self.spec_graphs is not None and self._spec_graph_eligible(chunks):
            return self._speculative_graph_step(chunks)
        checkpoints = {id(c): VerifyCheckpoint.take(self.store, c.seq.cache, c.start, c.length)
                       for c in chunks if c.draft}
        known = {c.seq.request_id: c.seq.num_tokens for c in chunks}
        hidden: dict[str, torch.Tensor] = {}
        logits = self._forward(chunks, checkpoints, hidden)
        events: list[Event] = []
        work: list[MTPWork] = []
        for c in chunks:
            seq = c.seq
            if seq.status is not Status.RUNNING:
                continue
            reason = None
            uniforms = None
            if c.draft:
                rows = logits[seq.request_id]
                probs = seq.draft.probs[:len(c.draft)] if seq.draft.probs is not None else None
                if seq.params.temperature > 0:      # the acceptance's, then the next drafts'
                    uniforms = step_uniforms(len(c.draft) + 1 + self.ec.num_speculative_tokens, seq.generator,
                                             self.device)
                tokens = accept(rows, Draft(c.draft, probs), seq.params, uniforms)
                usable = self._usable_drafts(seq, len(c.draft))
                for i, t in enumerate(tokens):
                    event, reason = self._add_token(seq, rows[i], scored(rows[i], t, seq.params))
                    events.append(event)
                    if reason:
                        break
                emitted = i + 1
                self._count_verify(seq, usable, len(tokens) - 1)
                checkpoints[id(c)].rollback(self.model, emitted)
                seq.num_computed = c.start + emitted
                self._drop_rejected(seq)
            else:
                seq.num_computed = c.start + c.length
            seq.draft = None
            self.prefix.register(seq.root, seq.block_hashes, seq.token_ids, seq.cache, seq.num_computed)
            self._publish_snapshots(seq)
            if not c.draft and c.wants_logits:
                event, reason = self._add_token(seq, logits[seq.request_id],
                                                sample(logits[seq.request_id], seq.params, seq.generator))
                events.append(event)
            if reason:
                self._finish(seq, reason)
                continue
            # the MTP block needs the last `window` positions before decoding starts, and every one after
            first = max(c.start, known[seq.request_id] - self.config.sliding_window)
            if first < seq.num_computed:
                h = hidden[seq.request_id][first - c.start:seq.num_computed - c.start]
                drafts_u = uniforms[len(c.draft) + 1:] if uniforms is not None else None
                work.append(MTPWork(seq, first, h, self._draft_len(seq), drafts_u))
        for rid, draft in self.drafter.run(work).items():
            self.requests[rid].draft = draft
        self.stats.steps += 1
        self.stats.forward_tokens += sum(c.length for c in chunks)
        return events

    def _spec_graph_eligible(self, chunks: list[Chunk]) -> bool:
        """Whether this step can replay `SpeculativeGraphs`: every request verifies k drafts past its
        prefix hit's frozen blocks (a snapshot at a block boundary among the verified positions is
        put together after the replay: `SpeculativeGraphs.boundary_state`)."""
        k = self.ec.num_speculative_tokens
        for c in chunks:
            s = c.seq
            if (not c.draft or len(c.draft) != k or c.length != k + 1
                    or c.start < s.cache.frozen_until or s.mtp_start is None):
                return False
        return self.spec_graphs.eligible([c.seq.cache for c in chunks], [c.start for c in chunks])

    def _speculative_graph_step(self, chunks: list[Chunk]) -> list[Event]:
        """`_speculative_step` through `SpeculativeGraphs` (engine/spec_graphs.py): verify, acceptance,
        rollback and the next drafts in one replay; then the host emits the kept tokens."""
        k = self.ec.num_speculative_tokens
        graphs = self.spec_graphs
        by_params = any(c.seq.params.temperature > 0 or c.seq.params.logprobs for c in chunks)
        for c in chunks:      # drafts the eager drafter drew: their distributions where the graph reads them
            if c.seq.params.temperature > 0 and not c.seq.draft.on_device:
                graphs.put_draft_probs(c.seq.cache.slot, c.seq.draft.probs[:k])
        g = graphs.step([[c.seq.token_ids[c.start], *c.draft] for c in chunks], [c.seq.cache for c in chunks],
                        [c.start for c in chunks], [c.seq.mtp_start for c in chunks],
                        [c.seq.params for c in chunks] if by_params else None,
                        [c.seq.generator if c.seq.params.temperature > 0 else None for c in chunks])
        tokens, logprobs, accepted_counts, drafts, tops = graphs.results(g, len(chunks))
        snapshots = self.policy.snapshots and self.prefix.enabled
        events: list[Event] = []
        for b, c in enumerate(chunks):
            seq = c.seq
            accepted = accepted_counts[b]
            reason = None
            asked = seq.params.logprobs
            usable = self._usable_drafts(seq, k)
            for i, t in enumerate(tokens[b][:accepted + 1]):
                top = tops[b][i][:asked] if asked else None
                event, reason = self._add_token(seq, g.out["logits"][i, b], Sampled(t, logprobs[b][i], top))
                events.append(event)
                if reason:
                    break
            self._count_verify(seq, usable, accepted)
            seq.num_computed = c.start + i + 1
            self._drop_rejected(seq)
            seq.draft = None
            self.prefix.register(seq.root, seq.block_hashes, seq.token_ids, seq.cache, seq.num_computed)
            if snapshots:
                # the boundaries up to the last emitted position: the state after all the positions the
                # device kept is the state now; one after fewer is put together from the step's copies
                hook, bt, kept = self._snapshot_hook(seq), self.store.block_tokens, c.start + accepted + 1
                for end in range((c.start // bt + 1) * bt, seq.num_computed + 1, bt):
                    states = (graphs.boundary_state(g, b, seq.cache.slot, c.start, end - c.start) if end < kept
                              else [None] * self.store.num_layers)
                    for layer_id, state in enumerate(states):
                        hook(layer_id, end, state)
            self._publish_snapshots(seq)
            if reason:
                self._finish(seq, reason)
                continue
            n = self._draft_len(seq)
            if n:
                sampled_draft = seq.params.temperature > 0
                probs = [graphs.draft_probs[seq.cache.slot, j] for j in range(n)] if sampled_draft else None
                seq.draft = Draft(drafts[b][:n], probs, on_device=sampled_draft)
            else:
                seq.draft = None
        self.stats.steps += 1
        self.stats.spec_graph_steps += 1
        self.stats.forward_tokens += sum(c.length for c in chunks)
        return events

    def _draft_len(self, seq: Sequence) -> int:
        """Draft tokens for the request's next step (0 while in prefill): k, fewer where the model
        length ends it sooner. A request near its max_tokens still drafts k: its last steps (and so
        its batch's) keep the shape `SpeculativeGraphs` replays, and a seeded request draws the same
        uniforms whichever path its steps take; the host emits no token past max_tokens."""
        if seq.num_computed != seq.num_tokens - 1:
            return 0
        return max(0, min(self.ec.num_speculative_tokens, self.max_model_len - 1 - seq.num_tokens))

    @staticmethod
    def _usable_drafts(seq: Sequence, drafted: int) -> int:
        """Of a step's drafts, those whose tokens the request's max_tokens leaves room to emit (a
        request near it drafts k all the same: `_draft_len`); the metrics count these alone."""
        return max(0, min(drafted, seq.params.max_tokens - len(seq.output_ids) - 1))

    def _count_verify(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Metrics of one verify: `drafted` usable drafts (`_usable_drafts`), `accepted` of all of
        them (counted up to the usable ones). A step with none usable (one token left to emit) is
        not counted as a verify, as a step without drafts is not."""
        if not drafted:
            return
        accepted = min(accepted, drafted)
        st = self.stats
        st.spec_drafts += 1
        st.spec_draft_tokens += drafted
        st.spec_accepted_tokens += accepted
        for i in range(accepted):
            st.spec_accepted_per_pos[i] += 1
        st.spec_accepted_hist[accepted] += 1
        seq.spec_steps += 1
        seq.spec_draft_tokens += drafted
        seq.spec_accepted_tokens += accepted

    def _drop_rejected(self, seq: Sequence) -> None:
        """After a rollback: blocks only rejected positions needed go back to the pool (as many as a
        request decoded without speculation holds), snapshots past the kept positions are dropped."""
        table = seq.cache.block_table
        need = -(-seq.num_computed // self.store.block_tokens)
        while len(table) > need:
            self.store.pool.release(table.pop())
        seq.new_snapshots = [(b, snap) for b, snap in seq.new_snapshots if b <= seq.num_computed]
        seq.snapshots_below = [item for item in seq.snapshots_below if item[0] <= seq.num_computed]
        seq.pending_snapshots = {b: v for b, v in seq.pending_snapshots.items() if b <= seq.num_computed}

    def _forward(self, chunks: list[Chunk], checkpoints: dict | None = None,
                 hidden: dict | None = None) -> dict[str, torch.Tensor]:
        """One model forward over the step's chunks: prefill chunks as segments, single-token steps
        as one batched decode group. Returns the logits of every chunk that ends its request's
        known tokens ([vocab]; [length, vocab] for a verify chunk, which carries draft tokens).
        Verify chunks run through the views of their `checkpoints` (by chunk id); with `hidden`
        given, it receives every chunk's stream rows [length, hc, dim] by request id."""
        snapshots = self.policy.snapshots and self.prefix.enabled
        items, ids, logit_rows, owners = [], [], [], []
        spans: dict[str, tuple[int, int]] = {}      # request id -> (first row, rows)
        decodes = ([c for c in chunks if c.length == 1 and c.start >= c.seq.cache.frozen_until]
                   if self.ec.batched_decode else [])
        decode_ids = {id(c) for c in decodes}
        waved = self._verify_waves(chunks)
        wave_ids = {id(c) for c in waved}
        verifies: list[tuple] = []
        row = 0
        room = None     # snapshot bytes this forward may still take (_snapshot_room)
        ced = self.v41 and self.ec.ced_prefill and hidden is None
        decode_rows: list[int] = []
        for c in chunks:
            if id(c) in decode_ids:
                # a decode row keeps its chunk's place in the flat batch: every row-wise op (the GEMMs
                # included) sees the same rows as when it runs as a one-token segment
                decode_rows.append(row)
                ids.append(c.seq.token_ids[c.start])
                logit_rows.append(row)
                owners.append(c.seq.request_id)
                spans[c.seq.request_id] = (row, 1)
                row += 1
                continue
            seq = c.seq
            if id(c) in wave_ids:
                verifies.append((seq.cache, c.start, c.length, row, checkpoints[id(c)].rows))
                ids.extend(c.input_ids())
                spans[seq.request_id] = (row, c.length)
                row += c.length
                logit_rows.extend(range(row - c.length, row))
                owners.append((seq.request_id, c.length))
                continue
            unread, below = self._unread_boundaries(c) if snapshots else set(), set()
            if snapshots:
                if room is None:
                    room = self._snapshot_budget(chunks)
                skipped, below = self._snapshot_room(c, unread, room)
                unread |= skipped
            hook = self._snapshot_hook(seq, unread, below) if snapshots else None
            view = checkpoints[id(c)].view(hook) if c.draft else self.store.view(seq.cache, hook)
            points = ([b for b in self._inner_boundaries(c) if b > seq.cache.frozen_until and b not in unread]
                      if hook is not None else [])
            view.snapshot_at(points)   # a chunk runs whole: its layers keep the states at these boundaries
            pieces = c.segments
            if ced and points:         # except where a cut lets CED's decoder skip rows (ced.py)
                pieces = split_segments(pieces, cuts_that_skip(self.config, points, c.start + c.length))
            if self.memory.needs_attention_mass and c.wants_logits and seq.first_token_time is None:
                # the chunk that ends the prompt: record which entries its final queries attend to
                view.capture = seq.capture = AttentionCapture(self.ec.oracle_query_tokens, c.start + c.length)
            spans[seq.request_id] = (row, c.length)
            tokens = c.input_ids()
            for start, n in pieces:
                items.append((view, start, n, start + n not in unread))
                ids.extend(tokens[start - c.start:start - c.start + n])
                row += n
            if c.draft:
                logit_rows.extend(range(row - c.length, row))
                owners.append((seq.request_id, c.length))
            elif c.wants_logits:
                logit_rows.append(row - 1)
                owners.append(seq.request_id)
        if decodes and len(decodes) == len(chunks) and self.graphs is not None:
            graphed = self._graph_decode(decodes, snapshots)
            if graphed is not None:
                return graphed
        decode = None
        if decodes:
            positions = torch.tensor([c.start for c in decodes], dtype=torch.long)
            dkv = PagedDecodeKV(self.store, [c.seq.cache for c in decodes], positions,
                                self._group_hook(decodes) if snapshots else None)
            decode = (dkv, positions)
        # the snapshot hooks only where a verify chunk reaches a block boundary: waves without hooks
        # attend as one batch on the paged kernels' path (`Attention._attend_waves`)
        bt = self.store.block_tokens
        hooked = snapshots and any((c.start + c.length) // bt > c.start // bt for c in waved)
        waves = verify_waves(self.store, verifies, self._group_hook(waved) if hooked else None) if verifies else ()
        batch = ForwardBatch.build(items, self.device, decode, decode_rows, waves)
        if ced:
            batch.outputs = list(logit_rows)
        with torch.inference_mode():
            h = self.model(to_device(ids, self.device, torch.long), batch)
            if ced and self.model.last_ced is not None:
                self.stats.ced_skipped_rows += self.model.last_ced.skipped_rows
                self.stats.ced_skipped_flops += ced_skipped_flops(self.model, self.model.last_ced)
            out = self.model.logits(h[to_device(logit_rows, self.device, torch.long)]) if logit_rows else None
        if hidden is not None:
            hidden.update({rid: h[a:a + n] for rid, (a, n) in spans.items()})
        if self.memory.needs_query:
            self._query_rows = dict(spans)
            self._keep_prompt_tails(chunks, spans)
        logits, i = {}, 0
        for owner in owners:
            if isinstance(owner, tuple):       # a verify chunk: every row's logits
                logits[owner[0]] = out[i:i + owner[1]]
                i += owner[1]
            else:
                logits[owner] = out[i]
                i += 1
        return logits

    def _verify_waves(self, chunks: list[Chunk]) -> list[Chunk]:
        """The verify chunks whose rows run as decode rows, wave after wave (`speculative.verify_waves`):
        V4 with batched decode, past their prefix hit's frozen blocks, as `speculative_verify` says (auto:
        on CUDA always, on the CPU where two or more requests verify)."""
        mode = self.ec.speculative_verify
        if mode == "segments" or not self.ec.batched_decode or self.v41:
            return []
        waved = [c for c in chunks if c.draft and c.start >= c.seq.cache.frozen_until]
        return waved if mode == "waves" or self.device.type == "cuda" or len(waved) >= 2 else []

    def _group_hook(self, chunks: list[Chunk]):
        """`on_layer_done(seq_cache, layer, end_pos)` of a decode group over these chunks' requests: each
        request's snapshot hook."""
        hooks = {id(c.seq.cache): self._snapshot_hook(c.seq) for c in chunks}
        return lambda sc, layer, end: hooks[id(sc)](layer, end)

    def _graph_decode(self, decodes: list[Chunk], snapshots: bool,
                      ids: torch.Tensor | None = None) -> dict[str, torch.Tensor] | None:
        """A pure decode step through `self.graphs`, where it applies (None otherwise). The window-state
        snapshots the eager path takes layer by layer are taken after the step: a layer's state is
        final once it has run. `ids`: the input tokens on the device (default: the requests' own)."""
        seqs, positions = [c.seq.cache for c in decodes], [c.start for c in decodes]
        if not (DecodeGraphs.supported(self.model, self.store, self._indexer_mode)
                and self.graphs.eligible(seqs, positions)):
            return None
        logits = self.graphs.run([c.seq.token_ids[c.start] for c in decodes] if ids is None else ids, seqs, positions)
        if self.memory.needs_query:
            # the target layers' inputs of this step: a captured graph's own buffers, refilled by every
            # replay (its forward hooks ran only while it was captured); the eager fixed forward's fresh
            g = self.graphs.last
            if g.graph is None or "query_x" not in g.extra:
                g.extra["query_x"] = dict(self._query_x)
            self._query_x = dict(g.extra["query_x"])
            self._query_rows = {c.seq.request_id: (i, 1) for i, c in enumerate(decodes)}
        if snapshots:
            for c in decodes:
                hook = self._snapshot_hook(c.seq)
                for layer_id in range(self.store.num_layers):
                    hook(layer_id, c.start + 1)
        self.stats.graph_steps += 1
        return {c.seq.request_id: logits[i] for i, c in enumerate(decodes)}

    def _inner_boundaries(self, c: Chunk) -> list[int]:
        """The block boundaries strictly inside the chunk."""
        bt = self.store.block_tokens
        return list(range((c.start // bt + 1) * bt, c.start + c.length, bt))

    def _unread_boundaries(self, c: Chunk) -> set[int]:
        """The chunk's inner block boundaries whose state no later step reads: no snapshot is kept
        there (`full` keeps one at every block; `checkpoint(N)` at multiples of N and at the request's
        last boundary; `zero` none). CED skips the decoder there."""
        if self.policy.kind == "full":
            return set()
        last = c.seq.num_tokens // self.store.block_tokens * self.store.block_tokens
        return {e for e in self._inner_boundaries(c) if e != last and not self.policy.publishes(e)}

    def _snapshot_budget(self, chunks: list[Chunk]) -> list[int]:
        """Snapshot bytes a forward over these chunks may take: [on the device (the snapshot store's
        budget), for the lower tiers (what their writer would queue after the blocks it completes)]."""
        bt = self.store.block_tokens
        blocks = sum((c.start + c.length) // bt - c.start // bt for c in chunks)
        return [self.prefix.snapshots.capacity, self.prefix.state_room(blocks)]

    def _snapshot_room(self, c: Chunk, unread: set[int], room: list[int]) -> tuple[set[int], set[int]]:
        """Of the chunk's block boundaries (inside it or at its end) whose state a later step may read:
        (those that get no snapshot, those whose snapshot goes to the lower tiers alone). The newest
        that fit what is left of the device's budget are kept there (and written through); older
        ones, as many as the tiers' writer would queue, are copied to host memory as each layer
        hands its state over, for the tiers alone; the rest are not taken. `room` ([device bytes,
        tier bytes] this forward may still take) shrinks by what they take. Why: a chunk holds its
        states until its last layer has run, and the store would keep only the newest of them (a
        16K-token chunk of V4-Flash has 128 boundaries of 14.7 MiB each)."""
        size, end = self.snapshot_nbytes, c.start + c.length
        ends_block = end % self.store.block_tokens == 0
        read = [b for b in self._inner_boundaries(c) + ([end] if ends_block else [])
                if b > c.seq.cache.frozen_until and b not in unread]
        if not read or size == 0:
            return set(), set()
        kept = min(len(read), room[0] // size)
        room[0] -= kept * size
        room[1] = max(0, room[1] - kept * size)        # the kept ones are written through as well
        older = read[:len(read) - kept]
        below = min(len(older), room[1] // size)
        room[1] -= below * size
        skipped = set(older[below:])
        self.prefix.snapshots_skipped += len(skipped)
        return skipped, set(older[:below])

    def _snapshot_hook(self, seq: Sequence, unread: set[int] = frozenset(), below: set[int] = frozenset()):
        """`on_layer_done` of one request: collects each layer's state at the block boundaries a
        snapshot is taken at; once every layer has passed one, the snapshot is the request's to publish.
        Boundaries in `below` are copied to host memory as each layer hands them over."""
        bt = self.store.block_tokens
        n_layers = self.store.num_layers

        def on_layer_done(layer_id: int, end_pos: int, state: list[torch.Tensor] | None = None) -> None:
            if end_pos % bt or end_pos <= seq.cache.frozen_until or end_pos in unread:
                return
            per_layer = seq.pending_snapshots.setdefault(end_pos, {})
            state = state if state is not None else self.prefix.capture(seq.cache.slot, layer_id)
            per_layer[layer_id] = self._host_copy(state) if end_pos in below else state
            if len(per_layer) == n_layers:
                seq.pending_snapshots.pop(end_pos)
                snap = [per_layer[i] for i in range(n_layers)]
                if end_pos in below:
                    ready = torch.cuda.Event() if self.device.type == "cuda" else None
                    if ready is not None:
                        ready.record(torch.cuda.current_stream(self.device))
                    seq.snapshots_below.append((end_pos, snap, ready))
                else:
                    seq.new_snapshots.append((end_pos, snap))
        return on_layer_done

    def _host_copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors copied into pinned host memory, asynchronously (the caller records an event
        after the last copy); host tensors as they are."""
        if self.device.type != "cuda":
            return tensors
        return [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in tensors]

    def _publish_snapshots(self, seq: Sequence) -> None:
        """Publish the boundaries the policy keeps; remember the latest one (checkpoint policy
        publishes it when the request ends). Snapshots taken for the lower tiers alone go there (the
        writer waits for their copies)."""
        bt = self.store.block_tokens
        for boundary, snap, ready in seq.snapshots_below:
            if self.policy.publishes(boundary):
                self.prefix.publish_below(seq.block_hashes[boundary // bt - 1], snap, ready)
        seq.snapshots_below = []
        for boundary, snap in seq.new_snapshots:
            if self.policy.publishes(boundary):
                self.prefix.publish(seq.block_hashes[boundary // bt - 1], snap)
            seq.rolling_snapshot = (boundary, snap)
        seq.new_snapshots = []

    def _emit(self, seq: Sequence, logits: torch.Tensor, s: Sampled) -> Event:
        event, reason = self._add_token(seq, logits, s)
        if reason:
            self._finish(seq, reason)
        return event

    def _add_token(self, seq: Sequence, logits: torch.Tensor, s: Sampled) -> tuple[Event, str | None]:
        """Append one sampled token to the request; the event and why the request ends with it
        (None: it goes on). The caller finishes it."""
        if self.record_logits:
            seq.step_logits.append(logits.detach().clone())
        now = time.perf_counter()
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.stats.cached_prompt_tokens += seq.num_cached_tokens
        seq.token_ids.append(s.token_id)
        seq.output_ids.append(s.token_id)
        seq.logprobs.append(s.logprob)
        if s.top_logprobs is not None:
            seq.top_logprobs.append(s.top_logprobs)
        self.stats.generation_tokens += 1
        if self.memory.offloads:
            self._after_token(seq)
        reason = self._stop_reason(seq, s.token_id)
        delta = ""
        if self.tokenizer is not None:
            # the token that stops the request is not text
            ids = seq.output_ids[:-1] if reason == "stop" else seq.output_ids
            delta, stopped = release(seq.decoded.decode(self.tokenizer, ids), seq.text, seq.params.stop,
                                     reason is not None)
            seq.text += delta
            reason = "stop" if stopped else reason
        return Event(seq.request_id, s.token_id, delta, reason is not None, reason, len(seq.output_ids) - 1), reason

    def _attach_memory_indexer(self) -> None:
        """flashmemory: load the memory indexer and have its target CSA layers record their attention
        input every forward (a recall scores from a request's last computed row)."""
        from pathlib import Path

        from hybridkv.memory.indexer import MemoryIndexer

        path = Path(self.ec.memory_indexer) if self.ec.memory_indexer else None
        if path is None or not (path.is_file() or (path / "memory_indexer.safetensors").is_file()):
            raise ConfigError(f"memory policy {self.memory} needs a memory indexer"
                              f"{f' (none at {path})' if path else ''}: train one with `hybridkv train-memory-indexer "
                              f"MODEL_DIR`, or name its file with --memory-indexer")
        mi = MemoryIndexer.load(path, self.device)
        c = self.config
        csa = [i for i, block in enumerate(self.model.layers) if getattr(block.attn, "indexer", None) is not None]
        if mi.config.dim != c.hidden_size or mi.config.head_dim != c.index_head_dim or not set(mi.config.layers) <= set(csa):
            raise ConfigError(f"{path}: a memory indexer for another model (layers {mi.config.layers}, dim "
                              f"{mi.config.dim}, key width {mi.config.head_dim}; this model: CSA layers {csa}, dim "
                              f"{c.hidden_size}, key width {c.index_head_dim})")
        self.memory.scorer = mi

        def recorder(layer: int):
            def hook(module, args):
                self._query_x[layer] = args[0]
            return hook
        for layer in mi.config.layers:
            self.model.layers[layer].attn.register_forward_pre_hook(recorder(layer))

    def _keep_prompt_tails(self, chunks: list[Chunk], spans: dict[str, tuple[int, int]]) -> None:
        """Append each prefill chunk's rows of the target layers' attention inputs to its request's
        prompt tail (the last `query_rows` positions), so that the first recall scores from the same
        rows however the prompt was cut into chunks (a tail that does not end where the chunk starts,
        as after a preemption, is dropped)."""
        q = self.memory.query_rows
        for c in chunks:
            rid = c.seq.request_id
            if c.draft or c.start + c.length > len(c.seq.prompt_ids) or rid not in spans:
                continue          # decode rows score from themselves
            first, n = spans[rid]
            end, tail = self._prompt_tail.get(rid, (None, {}))
            if end != c.start:
                tail = {}
            self._prompt_tail[rid] = (c.start + c.length, {
                layer: torch.cat([tail.get(layer, x[:0]), x[first:first + n]])[-q:].clone()
                for layer, x in self._query_x.items()})

    def _start_due_scores(self, seqs: list[Sequence]) -> "_DueScores | None":
        """On the paged kernels, before the next step is queued: the memory indexer scores every request
        whose decode recall this step's token runs, all at once (one scoring launch per target layer
        over the stored keys, reading this step's layer inputs), the policy's ranking key of each block
        is computed on the device (a key per block, not a probability per chunk, comes to the host),
        and its copy to the host starts. `_take_due_scores` waits for it, while the queued step runs
        (a recall's page changes are safe behind that step: page loads wait for the queued work,
        freed pages are rewritten only later). None when no recall is due."""
        if not self.memory.needs_query or self.store.kernel_formats is None:
            return None
        due = [s for s in seqs if s.output_ids and not len(s.output_ids) % self.memory.interval
               and s.request_id not in self._prompt_tail]
        if not due:
            return None
        ratio = self.model.layers[self.memory.scorer.config.layers[0]].attn.ratio
        block_chunks = self.store.block_tokens // ratio
        with torch.inference_mode():
            probs = self._due_probabilities(due)
            ranks = self.memory.block_ranks(probs, probs.shape[-1] // block_chunks, block_chunks)
            host = torch.empty(ranks.shape, dtype=ranks.dtype, pin_memory=ranks.is_cuda)
            host.copy_(ranks, non_blocking=True)
        done = None
        if ranks.is_cuda:
            done = torch.cuda.Event()
            done.record()
        return _DueScores([(s.request_id, s.num_computed // ratio // block_chunks) for s in due], host, done)

    def _take_due_scores(self, scoring: "_DueScores | None") -> None:
        """The ranking keys `_start_due_scores` queued, for `_after_token` to hand to the policy."""
        self._due_ranks = {}
        if scoring is None:
            return
        if scoring.done is not None:
            scoring.done.synchronize()
        ranks = scoring.ranks.numpy()
        for (rid, complete), r in zip(scoring.due, ranks):
            self._due_ranks[rid] = r[:complete]

    def _due_probabilities(self, due: list[Sequence]) -> torch.Tensor:
        """The memory indexer's probabilities [R, chunks visible to the furthest] of each request's
        last computed row (on the device; past a request's own visible chunks meaningless)."""
        mi = self.memory.scorer
        query_x, query_rows = self._query_x, self._query_rows
        last = torch.tensor([sum(query_rows[s.request_id]) - 1 for s in due], device=self.device)
        xs = {layer: query_x[layer].index_select(0, last) for layer in mi.config.layers}
        ratio = self.model.layers[mi.config.layers[0]].attn.ratio
        pos = [s.num_computed - 1 for s in due]
        batch = PagedBatch.build([(s.cache.slot, p, 1, s.cache.block_table) for s, p in zip(due, pos)],
                                 self.store.block_tokens, self.device)
        return mi.paged_probabilities(xs, batch.positions.long(), batch,
                                      {layer: self.store.entries[layer]["index"] for layer in mi.config.layers},
                                      ratio, self.store.kernel_formats[1], (max(pos) + 1) // ratio)

    def _memory_scores(self, seq: Sequence) -> torch.Tensor:
        """The memory indexer's probabilities [visible chunks] from the request's last computed row; at
        the prefill's end [2, visible chunks]: from the prompt's last row and the mean over its last
        `query_rows` rows (its question and what leads to it; `FlashMemory.chunks` takes from both)."""
        mi = self.memory.scorer
        pos = seq.num_computed - 1
        end, tail = self._prompt_tail.pop(seq.request_id, (None, None))
        if end == pos + 1:
            xs = tail
        else:
            first, n = self._query_rows[seq.request_id]
            query_x = self._query_x
            xs = {layer: query_x[layer][first + n - 1:first + n] for layer in mi.config.layers}
        rows = next(iter(xs.values())).shape[0]
        ratio = self.model.layers[mi.config.layers[0]].attn.ratio
        visible = (pos + 1) // ratio
        view = self.store.view(seq.cache)
        with torch.inference_mode():
            keys = {layer: view.layer(layer).entries("index", visible) for layer in mi.config.layers}
            positions = torch.arange(pos - rows + 1, pos + 1, device=self.device)
            probs = mi.probabilities(xs, positions, keys).float()
            if rows > 1:      # the prompt's last row and the mean over its last rows: the policy takes from both
                probs = torch.stack([probs[-1], probs.mean(0)])
        return probs.cpu() if rows > 1 else probs[0].cpu()

    def _after_token(self, seq: Sequence) -> None:
        """Run the memory policy when the prefill has ended, then every `interval` decode steps: its
        recall's pages are copied while the next steps decode, and the new resident set takes over
        at the first step after they have arrived."""
        self._count_recall(self.store.settle_recall(seq.cache))
        first = len(seq.output_ids) == 1
        steps = len(seq.output_ids) - 1
        if not first and steps % self.memory.interval:
            return
        mass = None
        if self.memory.needs_attention_mass and seq.capture is not None:
            per_block = self.store.block_tokens // 4
            n = len(seq.cache.block_table)
            mass = torch.zeros(n)
            for layer_mass in seq.capture.mass.values():
                blocks = torch.arange(layer_mass.numel()) // per_block
                mass.index_add_(0, blocks, layer_mass.cpu())
        extra = {}
        if self.memory.needs_query:
            ratio = self.model.layers[self.memory.scorer.config.layers[0]].attn.ratio
            extra = {"block_chunks": self.store.block_tokens // ratio}
            ranks = self._due_ranks.pop(seq.request_id, None)
            if ranks is not None:
                extra.update(block_ranks=ranks, visible_chunks=seq.num_computed // ratio)
            else:
                extra["chunk_probs"] = self._memory_scores(seq)
        ctx = PolicyContext(seq.request_id, len(seq.cache.block_table), seq.num_computed, self.store.block_tokens,
                            steps, seq.params.seed or 0, mass, extra)
        if seq.cache.recall is not None:        # the last recall's copies have not arrived yet
            self._count_recall(self.store.settle_recall(seq.cache, wait=True))
        if self._step_recalls is not None:      # `_emit_tokens` ranks and starts the step's recalls together
            self._step_recalls.append((seq, ctx))
            return
        keep = self.memory.resident(ctx)
        self.store.start_recall(seq.cache, keep)
        self._count_recall(self.store.settle_recall(seq.cache))

    def _emit_tokens(self, seqs: list[Sequence], rows, sampled) -> list[Event]:
        """Emit one token to each request; the recalls those tokens run (requests that started or were
        forked together recall in the same step) start together afterwards: one gather over the host
        pool for all of them. A request that its token ended recalls nothing."""
        self._step_recalls = []
        try:
            events = [self._emit(seq, row, s) for seq, row, s in zip(seqs, rows, sampled)]
            recalls = [(seq, ctx) for seq, ctx in self._step_recalls if seq.finish_reason is None]
        finally:
            self._step_recalls = None
        if recalls:
            keeps = self.memory.resident_many([ctx for _, ctx in recalls])
            self.store.start_recalls([(seq.cache, keep) for (seq, _), keep in zip(recalls, keeps)])
            for seq, _ in recalls:
                self._count_recall(self.store.settle_recall(seq.cache))
        return events

    def _count_recall(self, settled: tuple[int, int] | None) -> None:
        if settled is not None:
            self.stats.pages_loaded += settled[0]
            self.stats.pages_evicted += settled[1]

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        """Why the request ends with this token, stop strings aside (`release` finds those)."""
        p = seq.params
        if (not p.ignore_eos and token == self.config.eos_token_id) or token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._prompt_tail.pop(seq.request_id, None)
        if self.policy.kind == "checkpoint" and seq.rolling_snapshot is not None and seq.cache is not None:
            boundary, snap = seq.rolling_snapshot
            self.prefix.publish(seq.block_hashes[boundary // self.store.block_tokens - 1], snap)
        seq.rolling_snapshot = None
        self.prefix.finish(seq.block_hashes, seq.token_ids, seq.cache)
        if seq.cache is not None:
            seq.device_kv_bytes = self.store.device_bytes(seq.cache)
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        self.scheduler.finish(seq)
        self.requests.pop(seq.request_id, None)
        if self.finished is not None:
            self.finished[seq.request_id] = seq
        self.stats.requests_finished += 1
        self.stats.finish_reasons[reason] = self.stats.finish_reasons.get(reason, 0) + 1
