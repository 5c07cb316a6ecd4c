"""What every lower tier provides, and the counters each one reports.

A tier holds `Record`s by (kind, key) and reports its `usage()` (what it holds and its counters,
for /metrics, /stats and the web page). Each kind has a time since last use after which its
records expire (`ttl[kind]`; 0 = the tier does not hold the kind). Time comes from `clock`, a
callable returning seconds, so tests can move it. Tiers are used from the engine thread (lookups)
and the writer thread (puts) at once: they lock what they share.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass

from hybridkv.cache.tiers.record import Record

log = logging.getLogger("hybridkv.cache.tiers")


@dataclass
class TierStats:
    hits: int = 0              # records found and loaded
    misses: int = 0            # lookups that found nothing usable
    stored: int = 0            # records written
    stored_bytes: int = 0
    loaded_bytes: int = 0
    evictions: int = 0         # records removed for space (LRU)
    evicted_bytes: int = 0
    expired: int = 0           # records removed because their kind's time ran out
    bad: int = 0               # corrupted, truncated or foreign entries detected and removed
    errors: int = 0            # I/O failures (the tier degrades; requests go on)
    dropped: int = 0           # writes skipped (tier degraded, writer queue full)
    entries: int = 0           # records held now (as far as this process knows)
    bytes: int = 0             # bytes held now (as far as this process knows)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Tier:
    name = "tier"
    capacity: int | None = None        # bytes the tier may hold (None: unknown or unbounded)
    counts_holdings = True             # whether stats.entries/bytes are what the tier holds

    def __init__(self, ttl: dict[str, float], clock=time.time):
        self.ttl, self.clock = dict(ttl), clock
        self.stats = TierStats()
        self.lock = threading.RLock()
        self._warned: set[str] = set()

    def holds(self, kind: str) -> bool:
        return self.ttl.get(kind, 0) > 0

    def expired(self, kind: str, last_use: float) -> bool:
        return self.clock() - last_use > self.ttl.get(kind, 0)

    def usage(self) -> dict[str, int | None]:
        """The counters of `TierStats` and the capacity; entries and bytes are None where the tier
        cannot know them (a Redis server shared with other engines)."""
        out = {**self.stats.as_dict(), "capacity": self.capacity}
        if not self.counts_holdings:
            out["entries"] = out["bytes"] = None
        return out

    def warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    # ----- the interface -----
    def contains(self, key: bytes, kind: str) -> bool:
        raise NotImplementedError

    def contains_many(self, keys: list[bytes], kind: str) -> list[bool]:
        return [self.contains(k, kind) for k in keys]

    def get(self, key: bytes, kind: str) -> Record | None:
        raise NotImplementedError

    def put(self, record: Record) -> None:
        raise NotImplementedError

    def discard(self, key: bytes, kind: str) -> None:
        """Remove a record found unusable by the caller (counted as bad)."""
        raise NotImplementedError

    def close(self) -> None:
        pass
