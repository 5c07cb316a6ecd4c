"""Prefix caching with a sliding window: block hashes, window policies, and state snapshots.

A prefix hit at position H (a multiple of the block size) needs the compressed KV of the blocks
before H — cached in the block pool under their chain hashes — and the window and compressor
state at H. The window policy decides how that state is obtained:
- `full`: a snapshot of the state is kept at every block boundary;
- `checkpoint(N)`: at every N tokens, and at the last boundary each request passed;
- `zero`: none is kept; the hit recomputes the window from the last block's tokens
  [H − block, H) with queries attending only inside it (bounded replay). Replayed state is never
  written back; the result approximates a cold run (V4.1 is trained for it).
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

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
    """The device prefix cache: matches a new request's tokens against cached blocks and state
    snapshots, publishes the blocks and snapshots requests produce, and counts hits."""

    def __init__(self, store, policy: WindowPolicy, snapshot_bytes: int, enabled: bool = True):
        self.store, self.policy, self.enabled = store, policy, enabled
        self.block_tokens = store.block_tokens
        self.snapshots = SnapshotStore(snapshot_bytes)

    def match(self, root: bytes, tokens: list[int]) -> PrefixHit:
        """The longest usable cached prefix (at least one token is always left to compute)."""
        if not self.enabled:
            return PrefixHit(0, [], [], None)
        bt = self.block_tokens
        hashes = chain_hashes(root, tokens, bt, (len(tokens) - 1) // bt)
        ids: list[int] = []
        for b, h in enumerate(hashes):
            block_id = self.store.pool.lookup(h, tuple(tokens[b * bt:(b + 1) * bt]))
            if block_id is None:
                break
            ids.append(block_id)
        k = len(ids)
        snapshot = None
        if self.policy.snapshots:
            while k > 0 and (snapshot := self.snapshots.get(hashes[k - 1])) is None:
                k -= 1
        return PrefixHit(k * bt, ids[:k], hashes[:k], snapshot, replay=bt if (k and not self.policy.snapshots) else 0)

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
            self.store.pool.register(seq_cache.block_table[b], h, tuple(block_tokens))

    def capture(self, slot: int, layer_id: int) -> list[torch.Tensor]:
        return self.store.capture_state(slot, layer_id)

    def publish(self, key: bytes, snapshot: Snapshot) -> None:
        if self.enabled:
            self.snapshots.put(key, snapshot)
