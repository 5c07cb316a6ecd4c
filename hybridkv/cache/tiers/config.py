"""Configuration of the lower prefix-cache tiers, for the Python API and the command line.

Every tier keeps each kind of record for a time since its last use (its TTL or lifetime); a time
of 0 keeps that kind out of the tier. Defaults follow V4/V4.1's deployment: compressed KV and
indexer keys ("block") live 72 hours; window and compressor state ("state") minutes in DRAM and
Redis, an hour on disk (so an engine restarted soon after hits exactly).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from hybridkv.cache.tiers.record import KINDS
from hybridkv.errors import ConfigError

HOUR = 3600.0
WRITE_POLICIES = ("write_through", "request_end")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_SIZES = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_seconds(text: str | float | int) -> float:
    """'72h' -> 259200, '10m' -> 600, '30' -> 30, 'inf' -> no limit."""
    if isinstance(text, (int, float)):
        return float(text)
    t = text.strip().lower()
    if t in ("inf", "none", "forever"):
        return float("inf")
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([smhd]?)", t)
    if not m:
        raise ConfigError(f"not a duration: {text!r} (e.g. 30s, 10m, 72h, 3d)")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_size(text: str | int) -> int:
    """'1G' -> 1073741824, '512MiB' -> 536870912, '0' -> 0."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-z]*)", text.strip().lower())
    if not m or m.group(2) not in _SIZES:
        raise ConfigError(f"not a size: {text!r} (e.g. 0, 512M, 4G)")
    return int(float(m.group(1)) * _SIZES[m.group(2)])


def parse_lifetimes(value, default: dict[str, float]) -> dict[str, float]:
    """'block=72h,state=10m' (or one duration for both kinds, or a dict) -> {kind: seconds}."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (int, float)) or "=" not in str(value):
        items = [(k, value) for k in KINDS]
    else:
        items = [part.split("=", 1) for part in str(value).split(",") if part.strip()]
    out = dict(default)
    for kind, t in items:
        kind = kind.strip()
        if kind not in KINDS:
            raise ConfigError(f"unknown cache kind {kind!r}; the kinds are {', '.join(KINDS)}")
        out[kind] = parse_seconds(t)
        if out[kind] < 0:
            raise ConfigError(f"{kind} lifetime must be >= 0 (0 keeps the kind out of the tier)")
    return out


@dataclass
class TierConfig:
    """The tiers under the device pool: host DRAM (on by default), a disk directory (off until a
    directory is given), a Redis server shared by several engines (off until a URL is given)."""

    dram_bytes: int = 1 << 30
    dram_ttl: dict[str, float] = field(default_factory=lambda: {"block": 72 * HOUR, "state": 600.0})
    disk_dir: str | None = None
    disk_bytes: int = 16 << 30
    disk_lifetime: dict[str, float] = field(default_factory=lambda: {"block": 72 * HOUR, "state": HOUR})
    disk_fsync: bool = False             # entries are checksummed either way; fsync also survives power loss
    redis_url: str | None = None         # e.g. redis://127.0.0.1:6379/0
    redis_ttl: dict[str, float] = field(default_factory=lambda: {"block": 72 * HOUR, "state": 600.0})
    redis_prefix: str = "hybridkv"
    write_policy: str = "write_through"  # write_through (each block as it completes) | request_end
    max_pending_bytes: int = 512 << 20   # writes queued beyond this are dropped (and counted)

    def __post_init__(self) -> None:
        self.dram_bytes, self.disk_bytes = parse_size(self.dram_bytes), parse_size(self.disk_bytes)
        self.max_pending_bytes = parse_size(self.max_pending_bytes)
        self.dram_ttl = parse_lifetimes(self.dram_ttl, TierConfig.__dataclass_fields__["dram_ttl"].default_factory())
        self.disk_lifetime = parse_lifetimes(self.disk_lifetime,
                                             TierConfig.__dataclass_fields__["disk_lifetime"].default_factory())
        self.redis_ttl = parse_lifetimes(self.redis_ttl,
                                         TierConfig.__dataclass_fields__["redis_ttl"].default_factory())
        if min(self.dram_bytes, self.disk_bytes, self.max_pending_bytes) < 0:
            raise ConfigError("tier sizes must be >= 0")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"unknown write policy {self.write_policy!r}; use {' or '.join(WRITE_POLICIES)}")
        if self.disk_dir in ("", "none"):
            self.disk_dir = None
        if self.redis_url in ("", "none"):
            self.redis_url = None
        if self.redis_url and not re.match(r"^(redis|rediss|unix)://", self.redis_url):
            raise ConfigError(f"redis URL {self.redis_url!r} must start with redis://, rediss:// or unix://")


def add_tier_arguments(p: argparse.ArgumentParser) -> None:
    """The --kv-* options of every command that runs an engine."""
    g = p.add_argument_group("prefix-cache tiers")
    g.add_argument("--kv-dram-size", default="1G", help="host DRAM pool (0 = off; default %(default)s)")
    g.add_argument("--kv-dram-ttl", default=None, help="per kind since last use, e.g. block=72h,state=10m")
    g.add_argument("--kv-disk-dir", default=None, help="persist the prefix cache in this directory (off by default)")
    g.add_argument("--kv-disk-size", default="16G", help="disk tier size limit, LRU within it (default 16G)")
    g.add_argument("--kv-disk-lifetime", default=None, help="per kind, default block=72h,state=1h")
    g.add_argument("--kv-redis-url", default=None, help="a Redis server shared by several engines, redis://HOST:PORT/DB")
    g.add_argument("--kv-redis-ttl", default=None, help="per kind, default block=72h,state=10m")
    g.add_argument("--kv-write-policy", choices=WRITE_POLICIES, default="write_through")


def tier_config_from_args(a: argparse.Namespace) -> TierConfig:
    opts = dict(dram_bytes=a.kv_dram_size, disk_dir=a.kv_disk_dir, disk_bytes=a.kv_disk_size,
                redis_url=a.kv_redis_url, write_policy=a.kv_write_policy)
    for name, value in (("dram_ttl", a.kv_dram_ttl), ("disk_lifetime", a.kv_disk_lifetime),
                        ("redis_ttl", a.kv_redis_ttl)):
        if value is not None:
            opts[name] = value
    return TierConfig(**opts)
