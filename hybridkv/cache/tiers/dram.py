"""The host-DRAM tier: records kept in process memory (pinned on CUDA by the tier chain), bounded
by bytes with least-recently-used eviction, each kind expiring a TTL after its last use."""

from __future__ import annotations

import time
from collections import OrderedDict

from hybridkv.cache.tiers.base import Tier
from hybridkv.cache.tiers.record import Record


class DramTier(Tier):
    name = "dram"

    def __init__(self, capacity_bytes: int, ttl: dict[str, float], clock=time.time):
        super().__init__(ttl, clock)
        self.capacity = capacity_bytes
        self._items: OrderedDict[tuple[str, bytes], tuple[Record, int, float]] = OrderedDict()

    def _live(self, k: tuple[str, bytes]) -> tuple[Record, int, float] | None:
        item = self._items.get(k)
        if item is not None and self.expired(k[0], item[2]):
            self._remove(k)
            self.stats.expired += 1
            return None
        return item

    def _remove(self, k: tuple[str, bytes]) -> int:
        _, size, _ = self._items.pop(k)
        self.stats.entries -= 1
        self.stats.bytes -= size
        return size

    def contains(self, key: bytes, kind: str) -> bool:
        with self.lock:
            return self._live((kind, key)) is not None

    def get(self, key: bytes, kind: str) -> Record | None:
        with self.lock:
            k = (kind, key)
            item = self._live(k)
            if item is None:
                self.stats.misses += 1
                return None
            rec, size, _ = item
            self._items[k] = (rec, size, self.clock())
            self._items.move_to_end(k)
            self.stats.hits += 1
            self.stats.loaded_bytes += size
            return rec

    def put(self, record: Record) -> None:
        if not self.holds(record.kind):
            return
        size = record.nbytes
        k = (record.kind, record.key)
        with self.lock:
            if size > self.capacity:
                self.stats.dropped += 1
                return
            if k in self._items:
                rec, s, _ = self._items[k]
                self._items[k] = (rec, s, self.clock())
                self._items.move_to_end(k)
                return
            self._items[k] = (record, size, self.clock())
            self.stats.entries += 1
            self.stats.bytes += size
            self.stats.stored += 1
            self.stats.stored_bytes += size
            while self.stats.bytes > self.capacity:
                old = next(iter(self._items))
                self.stats.evicted_bytes += self._remove(old)
                self.stats.evictions += 1

    def discard(self, key: bytes, kind: str) -> None:
        with self.lock:
            if (kind, key) in self._items:
                self._remove((kind, key))
                self.stats.bad += 1

    def sweep(self) -> None:
        """Drop every expired record now (lookups also drop them as they meet them)."""
        with self.lock:
            for k in list(self._items):
                self._live(k)
