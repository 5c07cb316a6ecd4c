"""The chain of lower tiers under the device pool: host DRAM -> disk -> Redis.

Lookups go down the chain; a hit in a lower tier is promoted into the tiers above it (DRAM at
once, disk and Redis through the writer). Writes never block the engine: `put` queues the record
(device tensors already copied by the caller) and a background thread copies it to host memory
(pinned on CUDA), encodes it once and hands it to every tier that keeps its kind. Past
`max_pending_bytes` of queued writes new ones are dropped and counted rather than waited for.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import torch

from hybridkv.cache.tiers.base import Tier, log
from hybridkv.cache.tiers.config import TierConfig
from hybridkv.cache.tiers.convert import to_host
from hybridkv.cache.tiers.disk import DiskTier
from hybridkv.cache.tiers.dram import DramTier
from hybridkv.cache.tiers.record import Record
from hybridkv.cache.tiers.redis_tier import RedisTier
from hybridkv.errors import CacheEntryError


class _Writer:
    """State shared by a TieredStore and its writer thread (the thread never holds the store, so
    an engine that is dropped without close() is still collected)."""

    def __init__(self, max_pending: int, pin: bool):
        self.q: queue.Queue = queue.Queue()
        self.lock = threading.Lock()
        self.pending = 0
        self.max_pending, self.pin = max_pending, pin
        self.dropped = 0
        self.errors = 0
        self.thread: threading.Thread | None = None

    def run(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                rec, targets, size = item
                try:
                    if rec.ready is not None:
                        rec.ready.synchronize()
                    host = to_host(rec, self.pin)
                    for tier in targets:
                        if tier.holds(host.kind):
                            tier.put(host)
                    host._encoded = None       # DRAM keeps the tensors, not a second copy as bytes
                except Exception:             # a failing tier must not stop the writer
                    self.errors += 1
                    log.exception("prefix-cache writer: storing a %s record failed", rec.kind)
                finally:
                    with self.lock:
                        self.pending -= size
            finally:
                self.q.task_done()

    def submit(self, rec: Record, targets: list[Tier]) -> bool:
        size = rec.nbytes
        with self.lock:
            if self.pending + size > self.max_pending:
                self.dropped += 1
                return False
            self.pending += size
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="hybridkv-kv-writer", daemon=True)
                self.thread.start()
        self.q.put((rec, targets, size))
        return True

    def room(self) -> int:
        with self.lock:
            return max(0, self.max_pending - self.pending)

    def flush(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.q.all_tasks_done:
            while self.q.unfinished_tasks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.q.all_tasks_done.wait(left)
        return True

    def stop(self, timeout: float | None = 60.0) -> None:
        """Let the thread finish the queued writes and end, and wait for it: a thread still ending
        while the process exits makes it abort ("terminate called without an active exception",
        on CUDA, when an engine was collected without close() just before the end)."""
        thread = self.thread
        if thread is not None:
            self.q.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)


def _flush_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store.flush(timeout=60.0)


class TieredStore:
    def __init__(self, tiers: list[Tier], identity: str, pin: bool = False, max_pending_bytes: int = 512 << 20,
                 write_policy: str = "write_through"):
        self.tiers, self.identity, self.write_policy = tiers, identity, write_policy
        self._writer = _Writer(max_pending_bytes, pin)
        self._closed = False
        # lockstep: each write is done before `put` returns, so that what a lookup finds depends on
        # the engine's calls alone (the ranks of a sharded engine each keep their own tiers and must
        # find the same hits at the same step)
        self.lockstep = False
        weakref.finalize(self, self._writer.stop)
        atexit.register(_flush_at_exit, weakref.ref(self))

    @classmethod
    def build(cls, config: TierConfig, identity: str, device: torch.device | str = "cpu",
              clock=time.time) -> "TieredStore | None":
        """The tiers a config asks for (None if it asks for none)."""
        tiers: list[Tier] = []
        if config.dram_bytes:
            tiers.append(DramTier(config.dram_bytes, config.dram_ttl, clock))
        if config.disk_dir:
            tiers.append(DiskTier(config.disk_dir, config.disk_bytes, config.disk_lifetime, identity, clock,
                                  fsync=config.disk_fsync))
        if config.redis_url:
            tiers.append(RedisTier(config.redis_url, config.redis_ttl, identity, config.redis_prefix, clock=clock))
        if not tiers:
            return None
        return cls(tiers, identity, torch.device(device).type == "cuda", config.max_pending_bytes,
                   config.write_policy)

    def tier(self, name: str) -> Tier | None:
        return next((t for t in self.tiers if t.name == name), None)

    def holds(self, kind: str) -> bool:
        return any(t.holds(kind) for t in self.tiers)

    # ----- lookups -----
    def present(self, keys: list[bytes], kind: str) -> list[bool]:
        """Which keys some tier holds (one round trip per tier)."""
        out = [False] * len(keys)
        for tier in self.tiers:
            todo = [i for i, p in enumerate(out) if not p]
            if not todo:
                break
            if tier.holds(kind):
                for i, hit in zip(todo, tier.contains_many([keys[i] for i in todo], kind)):
                    out[i] = hit
        return out

    def known_locally(self, key: bytes, kind: str) -> bool:
        return any(t.contains(key, kind) for t in self.tiers if t.holds(kind) and not isinstance(t, RedisTier))

    def get(self, key: bytes, kind: str, check=None) -> Record | None:
        """The record from the highest tier that has a usable one, promoted into the tiers above.
        `check(record)` may raise CacheEntryError: that tier's copy is then removed."""
        for i, tier in enumerate(self.tiers):
            if not tier.holds(kind):
                continue
            try:
                rec = tier.get(key, kind)
            except Exception:  # noqa: BLE001 - a tier that fails on one entry is a miss, not a failed step
                tier.stats.errors += 1
                log.exception("%s tier: reading a %s record failed; treated as a miss", tier.name, kind)
                continue
            if rec is None:
                continue
            if check is not None:
                try:
                    check(rec)
                except Exception as e:  # noqa: BLE001 - CacheEntryError, or a record that breaks the check
                    log.warning("%s tier: removed a %s record that does not fit: %s", tier.name, kind, e)
                    tier.discard(key, kind)
                    continue
            upper = [t for t in self.tiers[:i] if t.holds(kind)]
            if upper:
                self._writer.submit(rec, upper)
            return rec
        return None

    # ----- writes -----
    def put(self, rec: Record) -> None:
        """Queue a record for every tier (returns at once; the caller must not change its tensors)."""
        if not self._closed and self.holds(rec.kind):
            self._writer.submit(rec, self.tiers)
            if self.lockstep:
                self._writer.flush()

    def room(self, kind: str) -> int:
        """Bytes of records of this kind that `put` would queue now rather than drop (0 where no tier
        holds the kind)."""
        return self._writer.room() if not self._closed and self.holds(kind) else 0

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued writes are done (False if the timeout came first)."""
        return self._writer.flush(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._writer.stop()
        for t in self.tiers:
            t.close()

    # ----- reporting -----
    def usage(self) -> dict[str, dict[str, int | None]]:
        """Per tier, in chain order: bytes and entries held, capacity, hits, misses, evictions,
        expirations and the other counters of `TierStats`."""
        return {t.name: t.usage() for t in self.tiers}

    def stats(self) -> dict[str, dict[str, int]]:
        out = {t.name: t.stats.as_dict() for t in self.tiers}
        w = self._writer
        out["writer"] = {"pending_bytes": w.pending, "dropped": w.dropped, "errors": w.errors}
        return out
