"""Logical KV blocks: allocation, reference counts and the device prefix index.

A block covers `block_tokens` native positions (lcm of the compression ratios: 128 for V4) in
every layer at once, so one block id addresses 32 CSA entries, 32 indexer keys and 1 HCA entry of
every layer. A complete block may be *cached*: registered under the hash of its token chain so
later requests with the same prefix share it. Freed blocks are not cleared: cached ones keep their
contents and stay findable until the pool needs the space.

Free order matters (vLLM users saw 0% prefix hits on V4 when transient blocks evicted cached
prefixes): a freed block that holds no cached prefix goes to the front of the free queue and is
reused first; a freed cached block goes to the back, so cached prefixes are evicted oldest-freed
first and only when no uncached block is left.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


class OutOfBlocks(Exception):
    """The pool has no free block; the scheduler preempts or waits."""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    tokens: tuple[int, ...] | None = None  # token ids of a cached block, to confirm a hash hit


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("the block pool needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free blocks in reuse order: front = reused first. OrderedDict gives O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.evictions = 0

    # ----- allocation -----
    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A free block with ref count 1 (evicting a cached prefix only if no uncached block is free)."""
        if not self._free:
            raise OutOfBlocks()
        block_id, _ = self._free.popitem(last=False)
        b = self.blocks[block_id]
        if b.hash is not None:
            self._uncache(b)
            self.evictions += 1
        b.ref_count = 1
        return block_id

    def acquire(self, block_id: int) -> None:
        """Take one more reference to a block (a prefix hit on a cached block)."""
        b = self.blocks[block_id]
        if b.ref_count == 0:
            del self._free[block_id]
        b.ref_count += 1

    def release(self, block_id: int) -> None:
        b = self.blocks[block_id]
        if b.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than acquired")
        b.ref_count -= 1
        if b.ref_count == 0:
            self._free[block_id] = None
            if b.hash is None:
                self._free.move_to_end(block_id, last=False)

    # ----- prefix index -----
    def register(self, block_id: int, block_hash: bytes, tokens: tuple[int, ...]) -> int:
        """Publish a complete block under its chain hash. If an identical block is already cached,
        the existing one wins and its id is returned (the caller may switch to it)."""
        existing = self.cached.get(block_hash)
        if existing is not None and existing != block_id:
            return existing
        b = self.blocks[block_id]
        b.hash, b.tokens = block_hash, tokens
        self.cached[block_hash] = block_id
        return block_id

    def lookup(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].tokens != tokens:
            return None
        return block_id

    def _uncache(self, b: Block) -> None:
        if self.cached.get(b.hash) == b.block_id:
            del self.cached[b.hash]
        b.hash, b.tokens = None, None

    # ----- invariants -----
    def check(self) -> None:
        """Raise if the bookkeeping is inconsistent (used by tests after every scenario)."""
        free = set(self._free)
        for b in self.blocks:
            if b.ref_count < 0:
                raise AssertionError(f"block {b.block_id} has ref count {b.ref_count}")
            if (b.ref_count == 0) != (b.block_id in free):
                raise AssertionError(f"block {b.block_id}: ref count {b.ref_count} but free={b.block_id in free}")
        for h, i in self.cached.items():
            if self.blocks[i].hash != h:
                raise AssertionError(f"cached hash of block {i} is stale")

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)
