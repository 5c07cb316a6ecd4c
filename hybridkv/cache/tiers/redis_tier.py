"""The Redis tier: a DRAM pool shared by several engine processes or machines.

Values are the same checksummed entries as on disk, under `PREFIX:NS:KIND:HEXKEY` (NS names the
model and entry layout), each with Redis's own TTL for its kind, refreshed on every hit (GETEX).
Redis's `maxmemory` and `maxmemory-policy` (allkeys-lru or volatile-lru) bound its size. Engines
that share a server only ever SET identical bytes under a key, and check every value they read,
so they cannot corrupt each other. What the server holds is not counted here (other engines and
Redis's own expiry change it); its capacity is the server's `maxmemory`, read on connecting. If the
server cannot be reached, the tier pauses with a warning
and requests go on.
"""

from __future__ import annotations

import hashlib
import time

from hybridkv.cache.tiers.base import Tier, log
from hybridkv.cache.tiers.record import Record, decode
from hybridkv.errors import CacheEntryError, ConfigError


class RedisTier(Tier):
    name = "redis"
    counts_holdings = False

    def __init__(self, url: str, ttl: dict[str, float], identity: str, prefix: str = "hybridkv",
                 retry_after: float = 30.0, timeout: float = 2.0, clock=time.time):
        super().__init__(ttl, clock)
        try:
            import redis
        except ImportError:
            raise ConfigError("the Redis tier needs the redis client: pip install redis") from None
        self._errors = (redis.RedisError, OSError)
        self.url, self.identity, self.retry_after = url, identity, retry_after
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self.ns = f"{prefix}:{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
        self._retry_at = float("-inf")
        try:
            self.client.ping()
        except self._errors as e:
            self._failed(e)
        else:
            try:
                self.capacity = int(self.client.info("memory").get("maxmemory", 0)) or None   # 0: no limit
            except (*self._errors, ValueError):   # INFO may be disabled on a managed server
                pass

    def _k(self, kind: str, key: bytes) -> str:
        return f"{self.ns}:{kind}:{key.hex()}"

    def _px(self, kind: str) -> int | None:
        t = self.ttl.get(kind, 0)
        return None if t == float("inf") else max(1, int(t * 1000))

    def _up(self) -> bool:
        return time.monotonic() >= self._retry_at

    def _failed(self, e: Exception) -> None:
        self.stats.errors += 1
        self._retry_at = time.monotonic() + self.retry_after
        self.warn_once("down", f"Redis KV tier {self.url}: {e}; the tier pauses for {self.retry_after:.0f} s at a "
                               "time, requests go on without it")

    def contains_many(self, keys: list[bytes], kind: str) -> list[bool]:
        if not keys or not self.holds(kind) or not self._up():
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(kind, key))
            return [bool(x) for x in pipe.execute()]
        except self._errors as e:
            self._failed(e)
            return [False] * len(keys)

    def contains(self, key: bytes, kind: str) -> bool:
        return self.contains_many([key], kind)[0]

    def get(self, key: bytes, kind: str) -> Record | None:
        if not self.holds(kind) or not self._up():
            return None
        k, px = self._k(kind, key), self._px(kind)
        try:
            data = self.client.getex(k, px=px) if px is not None else self.client.get(k)
        except self._errors as e:
            self._failed(e)
            return None
        if data is None:
            self.stats.misses += 1
            return None
        try:
            rec = decode(bytearray(data), self.identity, kind, key)
        except CacheEntryError as e:
            self.stats.bad += 1
            self.stats.misses += 1
            log.warning("Redis KV tier %s: removed %s: %s", self.url, k, e)
            self._delete(k)
            return None
        self.stats.hits += 1
        self.stats.loaded_bytes += len(data)
        return rec

    def _delete(self, k: str) -> None:
        try:
            self.client.delete(k)
        except self._errors as e:
            self._failed(e)

    def put(self, record: Record) -> None:
        if not self.holds(record.kind):
            return
        if not self._up():
            self.stats.dropped += 1
            return
        data = record.encode(self.identity)
        try:
            self.client.set(self._k(record.kind, record.key), data, px=self._px(record.kind))
        except self._errors as e:
            self.stats.dropped += 1
            self._failed(e)
            return
        self.stats.stored += 1
        self.stats.stored_bytes += len(data)

    def discard(self, key: bytes, kind: str) -> None:
        self._delete(self._k(kind, key))
        self.stats.bad += 1

    def close(self) -> None:
        try:
            self.client.close()
        except self._errors:
            pass
