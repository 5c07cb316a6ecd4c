"""Prefix caching with a sliding window: block hashes, window policies, and state snapshots.

A prefix hit at position H (a multiple of the block size) needs the compressed KV of the blocks
before H — cached in the block pool under their chain hashes — and the window and compressor
state at H. The window policy decides how that state is obtained:
- `full`: a snapshot of the state is kept at every block boundary;
- `checkpoint(N)`: at every N tokens, and at the last boundary each request passed;
- `zero`: none is kept; the hit recomputes the window from the last block's tokens
  [H − block, H) with queries attending only inside it (bounded replay). Replayed state is never
  written back; the result approximates a cold run (V4.1 is trained for it).

Below the device sit the lower tiers (`cache.tiers`: host DRAM, disk, Redis). A block or snapshot
the device lacks is looked up there on admission and, if found and intact, loaded onto the device,
so a lower-tier hit restores exactly what a device hit has; blocks are confirmed by token ids
whatever tier they come from.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.cache.tiers.convert import block_record, check_block, load_block, snapshot_of, state_record
from hybridkv.errors import ConfigError


@dataclass(frozen=True)
class WindowPolicy:
    kind: str                 # "full" | "checkpoint" | "zero"
    interval: int = 0         # checkpoint spacing in tokens

    @classmethod
    def parse(cls, text: str, block_tokens: int) -> "WindowPolicy":
        t = text.strip().lower()
        if t in ("full", "zero"):
            return cls(t)
        m = re.fullmatch(r"checkpoint[(:=]?(\d+)\)?", t)
        if not m:
            raise ConfigError(f"unknown window policy {text!r}; use full, checkpoint(N) or zero")
        n = int(m.group(1))
        if n <= 0 or n % block_tokens:
            raise ConfigError(f"checkpoint interval {n} must be a positive multiple of the block size ({block_tokens})")
        return cls("checkpoint", n)

    @property
    def snapshots(self) -> bool:
        return self.kind != "zero"

    def publishes(self, boundary: int) -> bool:
        """Whether a snapshot at this boundary is published as soon as it is taken."""
        return self.kind == "full" or (self.kind == "checkpoint" and boundary % self.interval == 0)

    def __str__(self) -> str:
        return f"checkpoint({self.interval})" if self.kind == "checkpoint" else self.kind


def root_hash(model_identity: str, cache_salt: str | None) -> bytes:
    """The start of every hash chain: the model's identity and the tenant's salt, so that
    different models never share blocks and tenants cannot probe each other's prefixes."""
    h = hashlib.sha256(b"hybridkv-prefix-v1\0" + model_identity.encode())
    if cache_salt:
        h.update(b"\0salt\0" + cache_salt.encode())
    return h.digest()


def block_hash(parent: bytes, tokens) -> bytes:
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


def chain_hashes(root: bytes, tokens: list[int], block_tokens: int, count: int | None = None) -> list[bytes]:
    """Hashes of the first `count` complete blocks of `tokens`."""
    n = len(tokens) // block_tokens if count is None else count
    out, parent = [], root
    for b in range(n):
        parent = block_hash(parent, tokens[b * block_tokens:(b + 1) * block_tokens])
        out.append(parent)
    return out


Snapshot = list[list[torch.Tensor]]  # per layer: window ring, then (kv, score) per compressor


class SnapshotStore:
    """Window/compressor state at block boundaries, keyed by the chain hash of the block that ends
    there. Bounded by bytes; least recently used snapshots go first."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self._items: OrderedDict[bytes, tuple[Snapshot, int]] = OrderedDict()
        self.nbytes = 0
        self.stored = 0
        self.evicted = 0

    def put(self, key: bytes, snap: Snapshot) -> None:
        size = sum(t.nbytes for layer in snap for t in layer)
        if size > self.capacity:
            return
        if key in self._items:
            self._items.move_to_end(key)
            return
        while self.nbytes + size > self.capacity and self._items:
            _, (_, s) = self._items.popitem(last=False)
            self.nbytes -= s
            self.evicted += 1
        self._items[key] = (snap, size)
        self.nbytes += size
        self.stored += 1

    def get(self, key: bytes) -> Snapshot | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class PrefixHit:
    tokens: int                  # H: positions served from the cache
    block_ids: list[int]
    hashes: list[bytes]
    snapshot: Snapshot | None    # the state at H (full / checkpoint policies)
    replay: int = 0              # tokens before H to recompute (zero policy)


class PrefixCache:
    """The prefix cache: matches a new request's tokens against cached blocks and state snapshots
    (on the device first, then in the lower tiers, whose hits are promoted onto the device),
    publishes the blocks and snapshots requests produce (to the lower tiers as well, as each block
    completes or when the request ends), and counts hits."""

    def __init__(self, store, policy: WindowPolicy, snapshot_bytes: int, enabled: bool = True, tiers=None,
                 compute_tail: int = 1):
        """compute_tail: prompt tokens a hit always leaves to compute (≥ 1; flashmemory's first recall
        scores from the attention inputs of the prompt's last rows, which a hit would not compute)."""
        self.store, self.policy, self.enabled = store, policy, enabled
        self.compute_tail = max(1, compute_tail)
        self.block_tokens = store.block_tokens
        self.snapshots = SnapshotStore(snapshot_bytes)
        self.tiers = tiers if enabled else None      # a cache.tiers.TieredStore, or None
        self.device_hits = 0          # blocks found on the device
        self.device_state_hits = 0    # snapshots found on the device
        self.promoted = 0             # blocks brought onto the device from a lower tier
        self.registered = 0           # blocks published by requests
        self.snapshots_below = 0      # snapshots only the lower tiers were given (`publish_below`)
        self.snapshots_skipped = 0    # boundaries whose snapshot no store had room for (never taken)

    def match(self, root: bytes, tokens: list[int]) -> PrefixHit:
        """The longest usable cached prefix (at least `compute_tail` tokens are left to compute). Blocks
        found only in a lower tier are loaded onto the device here (as cached, unreferenced blocks,
        as many as leave one block free); `apply` then takes them like any device hit."""
        if not self.enabled:
            return PrefixHit(0, [], [], None)
        bt = self.block_tokens
        pool = self.store.pool
        hashes = chain_hashes(root, tokens, bt, max(0, len(tokens) - self.compute_tail) // bt)
        blocks = [tuple(tokens[b * bt:(b + 1) * bt]) for b in range(len(hashes))]
        ids: list[int | None] = []       # device block id, or None: in a lower tier
        lower = None
        room = pool.num_free - 1         # device blocks a promotion may take
        for b, h in enumerate(hashes):
            block_id = pool.lookup(h, blocks[b])
            if block_id is not None:
                room -= pool.blocks[block_id].ref_count == 0
            else:
                if self.tiers is None:
                    break
                if lower is None:
                    lower = [False] * b + self.tiers.present(hashes[b:], "block")
                if not lower[b] or room <= 0:
                    break
                room -= 1
            ids.append(block_id)
        k, snapshot, loaded = self._usable(hashes, blocks, ids)
        if k == 0:
            return PrefixHit(0, [], [], None)
        self.device_hits += sum(1 for i in ids[:k] if i is not None)
        if loaded:
            self._promote(hashes, blocks, ids, k, loaded)
        return PrefixHit(k * bt, list(ids[:k]), hashes[:k], snapshot,
                         replay=bt if not self.policy.snapshots else 0)

    def _usable(self, hashes, blocks, ids) -> tuple[int, Snapshot | None, dict]:
        """How many leading blocks can be served: each block on the device or loadable from a tier,
        and (full/checkpoint) a state snapshot at the end. Loads what the hit needs from the tiers."""
        k = len(ids)
        state_in_tier = None
        if self.policy.snapshots and self.tiers is not None and k:
            state_in_tier = self.tiers.present(hashes[:k], "state")
        loaded: dict[int, object] = {}
        while k > 0:
            snapshot = None
            if self.policy.snapshots:
                snapshot = self.snapshots.get(hashes[k - 1])
                if snapshot is not None:
                    self.device_state_hits += 1
                elif state_in_tier is not None and state_in_tier[k - 1]:
                    snapshot = self._load_state(hashes[k - 1])
                if snapshot is None:
                    k -= 1
                    continue
            for b in range(k):
                if ids[b] is None and b not in loaded:
                    rec = self.tiers.get(hashes[b], "block", check=lambda r, t=blocks[b]: check_block(self.store, r, t))
                    if rec is None:
                        k = b
                        break
                    loaded[b] = rec
            else:
                return k, snapshot, {b: r for b, r in loaded.items() if b < k}
        return 0, None, {}

    def _load_state(self, key: bytes) -> Snapshot | None:
        holder = []

        def check(rec):
            holder.append(snapshot_of(self.store, rec))
        if self.tiers.get(key, "state", check=check) is None:
            return None
        self.snapshots.put(key, holder[-1])
        return holder[-1]

    def _promote(self, hashes, blocks, ids, k, loaded) -> None:
        """Put loaded blocks into free device blocks and register them (device hits stay held
        meanwhile so that no allocation evicts them)."""
        pool = self.store.pool
        held = [i for i in ids[:k] if i is not None]
        for block_id in held:
            pool.acquire(block_id)
        for b in range(k):
            if ids[b] is None:
                block_id = pool.allocate()
                load_block(self.store, block_id, loaded[b])
                pool.register(block_id, hashes[b], blocks[b])
                ids[b] = block_id
                self.promoted += 1
        for b in reversed(range(k)):            # the prefix's head is released last: evicted last
            pool.release(ids[b])

    def apply(self, hit: PrefixHit, seq_cache) -> int:
        """Attach a hit to a fresh request slot; returns the first position to compute."""
        for block_id in hit.block_ids:
            self.store.pool.acquire(block_id)
        seq_cache.block_table = list(hit.block_ids)
        seq_cache.frozen_until = hit.tokens
        if hit.snapshot is not None:
            for layer_id, tensors in enumerate(hit.snapshot):
                self.store.restore_state(seq_cache.slot, layer_id, tensors)
            return hit.tokens
        seq_cache.window_start = hit.tokens - hit.replay
        return hit.tokens - hit.replay

    @property
    def write_through(self) -> bool:
        return self.tiers is not None and self.tiers.write_policy == "write_through"

    def register(self, root: bytes, hashes: list[bytes], tokens: list[int], seq_cache, num_computed: int) -> None:
        """Publish every block this request has completed (hashes grows in place)."""
        if not self.enabled:
            return
        bt = self.block_tokens
        while (len(hashes) + 1) * bt <= num_computed:
            b = len(hashes)
            block_tokens = tokens[b * bt:(b + 1) * bt]
            h = block_hash(hashes[-1] if hashes else root, block_tokens)
            hashes.append(h)
            owner = self.store.pool.register(seq_cache.block_table[b], h, tuple(block_tokens))
            self.registered += 1
            if self.write_through and owner == seq_cache.block_table[b]:   # else another request wrote it
                self.tiers.put(block_record(self.store, seq_cache.block_table[b], h, block_tokens))

    def capture(self, slot: int, layer_id: int) -> list[torch.Tensor]:
        return self.store.capture_state(slot, layer_id)

    def state_room(self, blocks: int = 0) -> int:
        """Bytes of snapshots the lower tiers would take now, after the records of `blocks` blocks
        about to be written: what their writer queues rather than drops, where states are written
        through (0 otherwise)."""
        if not (self.enabled and self.policy.snapshots and self.write_through):
            return 0
        block = sum(self.store.block_bytes().values()) + 4 * self.block_tokens   # entries + token ids
        return max(0, self.tiers.room("state") - (blocks * block if self.tiers.holds("block") else 0))

    def publish_below(self, key: bytes, snapshot: Snapshot, ready=None) -> None:
        """A snapshot for the lower tiers alone (the device's budget went to newer ones). `ready`: the
        CUDA event its host copies were recorded before."""
        if self.enabled and self.write_through and not self.tiers.known_locally(key, "state"):
            rec = state_record(key, snapshot)
            rec.ready = ready
            self.tiers.put(rec)
            self.snapshots_below += 1

    def publish(self, key: bytes, snapshot: Snapshot) -> None:
        if self.enabled:
            known = key in self.snapshots          # published before (checkpoint: again at request end)
            self.snapshots.put(key, snapshot)
            if self.write_through and not known:
                self.tiers.put(state_record(key, snapshot))

    def finish(self, hashes: list[bytes], tokens: list[int], seq_cache) -> None:
        """A request ends: under the request_end write policy, persist its blocks and the
        snapshots published at their ends (what the lower tiers already hold is skipped)."""
        if self.tiers is None or self.write_through or seq_cache is None:
            return
        bt = self.block_tokens
        for b, h in enumerate(hashes):
            if not self.tiers.known_locally(h, "block"):
                self.tiers.put(block_record(self.store, seq_cache.block_table[b], h, tokens[b * bt:(b + 1) * bt]))
            snap = self.snapshots.get(h) if self.policy.snapshots else None
            if snap is not None and not self.tiers.known_locally(h, "state"):
                self.tiers.put(state_record(h, snap))

    def clear_device(self) -> None:
        """Forget every cached block and snapshot on the device (blocks in use keep their data but
        are no longer findable); the lower tiers keep theirs. For benchmarks and tests."""
        pool = self.store.pool
        for b in pool.blocks:
            b.hash, b.tokens = None, None
        pool.cached.clear()
        self.snapshots = SnapshotStore(self.snapshots.capacity)

    def stats(self) -> dict[str, dict[str, int]]:
        """Counters per tier: the device pool, then each lower tier and the writer."""
        pool = self.store.pool
        per_block = sum(self.store.block_bytes().values())
        out = {"device": {"hits": self.device_hits, "state_hits": self.device_state_hits, "loaded": self.promoted,
                          "stored": self.registered, "stored_bytes": self.registered * per_block,
                          "loaded_bytes": self.promoted * per_block, "evictions": pool.evictions,
                          "evicted_bytes": pool.evictions * per_block, "entries": len(pool.cached),
                          "bytes": len(pool.cached) * per_block + self.snapshots.nbytes,
                          "snapshots": len(self.snapshots), "snapshot_bytes": self.snapshots.nbytes}}
        if self.tiers is not None:
            out.update(self.tiers.stats())
        return out
