"""Continuous batching: which requests run in the next forward, and with how many tokens.

Each step has a token budget. Decoding requests go first (one token each, plus their draft tokens
under speculative decoding: a verify chunk), then requests still in
prefill get chunks, then waiting requests are admitted (after a prefix-cache lookup) while slots,
blocks and budget remain. A chunk runs whole; where the window policy takes state snapshots at
block boundaries inside it, the layers keep those states from its rows. When a running request
needs a block and none is free, the most recently admitted request is preempted: its blocks are
freed and it will be recomputed.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from hybridkv.cache.block_pool import OutOfBlocks
from hybridkv.cache.paged import PagedKVStore
from hybridkv.cache.prefix import PrefixCache
from hybridkv.engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    seq: Sequence
    start: int
    length: int
    segments: list[tuple[int, int]]   # (start_pos, length) pieces, in order
    wants_logits: bool                 # ends at the request's last known token
    draft: list[int] = field(default_factory=list)   # speculative: draft tokens after the last known one

    def input_ids(self) -> list[int]:
        """The token ids of positions [start, start + length)."""
        if self.draft:
            return self.seq.token_ids[self.start:self.start + 1] + self.draft
        return self.seq.token_ids[self.start:self.start + self.length]


def split_segments(segments: list[tuple[int, int]], cuts: list[int]) -> list[tuple[int, int]]:
    """(start_pos, length) pieces cut further at the positions in `cuts` that fall inside them."""
    out = []
    for start, n in segments:
        bounds = [start, *(p for p in cuts if start < p < start + n), start + n]
        out += [(a, b - a) for a, b in zip(bounds, bounds[1:])]
    return out


class Scheduler:
    def __init__(self, store: PagedKVStore, prefix: PrefixCache, max_num_seqs: int, max_batched_tokens: int):
        self.store, self.prefix = store, prefix
        self.max_num_seqs, self.budget = max_num_seqs, max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # requests whose admission raised (a failing cache tier, ...), with why: the engine ends them,
        # alone; left at the queue's head they would fail every step after
        self.unadmitted: list[tuple[Sequence, str]] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- blocks -----
    def _ensure_blocks(self, seq: Sequence, end_pos: int) -> None:
        need = -(-end_pos // self.store.block_tokens)
        table = seq.cache.block_table
        while len(table) < need:
            table.append(self.store.pool.allocate())
        self.store.attach_pages(seq.cache)

    def extend_decodes(self, seqs: list[Sequence]) -> bool:
        """Blocks for one more decode position of each request (the position after its computed
        ones), if the pool holds them all without a preemption; False, allocating nothing, if not."""
        need = sum(self._new_blocks(seq, seq.num_computed + 1) for seq in seqs)
        if need > self.store.pool.num_free:
            return False
        for seq in seqs:
            self._ensure_blocks(seq, seq.num_computed + 1)
        return True

    def _new_blocks(self, seq: Sequence, end_pos: int) -> int:
        return max(0, -(-end_pos // self.store.block_tokens) - len(seq.cache.block_table))

    def _free(self, seq: Sequence) -> None:
        if seq.cache is not None:
            self.store.free_seq(seq.cache)
            seq.cache = None

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    # ----- chunks -----
    def _segments(self, start: int, n: int) -> list[tuple[int, int]]:
        # one piece: the layers keep the state at the block boundaries inside a chunk from its rows
        # (`PagedSeqKV.snapshot_at`), where the window policy takes snapshots
        return [(start, n)]

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        start = seq.num_computed
        return Chunk(seq, start, n, self._segments(start, n), start + n == seq.num_tokens)

    def _grow(self, seq: Sequence, end_pos: int, scheduled: list[Chunk]) -> bool:
        """Blocks for positions < end_pos, preempting newer requests if needed. False if `seq`
        itself had to be preempted."""
        busy = {c.seq.request_id for c in scheduled}
        while True:
            try:
                self._ensure_blocks(seq, end_pos)
                return True
            except OutOfBlocks:
                victims = [s for s in reversed(self.running) if s is not seq and s.request_id not in busy]
                if victims:
                    self.preempt(victims[0])
                else:
                    self.preempt(seq)
                    return False

    def schedule(self) -> list[Chunk]:
        scheduled: list[Chunk] = []
        budget = self.budget
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue
            draft = seq.draft.tokens[:budget - 1] if seq.draft is not None else []
            if draft and self._new_blocks(seq, seq.num_computed + 1 + len(draft)) > self.store.pool.num_free:
                draft = []       # draft tokens never preempt a request: this step decodes one token
            n = 1 + len(draft)
            if self._grow(seq, seq.num_computed + n, scheduled):
                chunk = self._chunk(seq, n)
                if draft:
                    chunk.draft, chunk.wants_logits = draft, True
                scheduled.append(chunk)
                budget -= n
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or not seq.in_prefill or any(c.seq is seq for c in scheduled):
                continue
            n = min(budget, seq.num_tokens - seq.num_computed)
            if self._grow(seq, seq.num_computed + n, scheduled):
                scheduled.append(self._chunk(seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.store.num_free_slots:
            seq = self.waiting[0]
            try:
                admitted = self._admit(seq)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                log.exception("admitting request %s failed", seq.request_id)
                self.waiting.popleft()
                self._free(seq)
                self.unadmitted.append((seq, f"internal error while admitting the request ({type(e).__name__}: {e})"))
                continue
            if not admitted:
                break
            self.waiting.popleft()
            self.running.append(seq)
            n = min(budget, seq.num_tokens - seq.num_computed)
            if not self._grow(seq, seq.num_computed + n, scheduled):
                break
            scheduled.append(self._chunk(seq, n))
            budget -= n
        return scheduled

    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting request a slot and its cached prefix. False if the pool cannot hold its
        first new block now (it stays waiting until running requests free some)."""
        hit = self.prefix.match(seq.root, seq.token_ids)
        pool = self.store.pool
        revived = sum(1 for b in hit.block_ids if pool.blocks[b].ref_count == 0)  # leave the free queue
        if pool.num_free - revived < 1 and self.running:
            return False
        seq.cache = self.store.new_seq()
        seq.num_computed = self.prefix.apply(hit, seq.cache)
        seq.block_hashes = list(hit.hashes)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(hit.tokens, len(seq.prompt_ids))
            seq.num_replayed_tokens = hit.replay
        seq.status = Status.RUNNING
        return True
