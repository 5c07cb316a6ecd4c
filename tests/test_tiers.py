"""The lower prefix-cache tiers on their own: the entry format and its checks, DRAM TTLs and LRU,
the disk tier (restart, lifetimes, LRU, corruption, foreign entries, killed writers, shared
directories, unwritable directories) and the Redis tier against a real redis-server."""

import hashlib
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from hybridkv.cache.tiers.config import TierConfig, parse_lifetimes
from hybridkv.cache.tiers.disk import DiskTier
from hybridkv.cache.tiers.dram import DramTier
from hybridkv.cache.tiers.record import Record, compact, decode, encode
from hybridkv.cache.tiers.redis_tier import RedisTier
from hybridkv.cache.tiers.store import TieredStore
from hybridkv.errors import CacheEntryError, ConfigError

ID = "identity-a"
ROOT = Path(__file__).resolve().parents[1]
H = 3600.0


class Clock:
    def __init__(self, t=1_000_000.0):
        self.t = t

    def __call__(self):
        return self.t


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def rec(i: int, kind="block", n=1000) -> Record:
    g = torch.Generator().manual_seed(i)
    return Record(kind, key(i), {"0.kv": torch.randn(n, generator=g), "0.index": torch.randint(0, 255, (64,),
                  dtype=torch.uint8, generator=g), "tokens": torch.arange(i, i + 8, dtype=torch.int32)})


def same(a: Record, b: Record) -> bool:
    return a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


# ----- the entry format -----
def test_record_round_trip_and_fill_tensors():
    t = {"a": torch.randn(3, 5), "b": torch.randn(4, 2).to(torch.bfloat16), "c": torch.arange(7, dtype=torch.uint8),
         "d": compact(torch.full((8, 16), float("-inf"))), "e": torch.zeros(0, 4)}
    r = Record("state", key(1), t)
    data = encode(r, ID)
    back = decode(bytearray(data), ID, "state", key(1))
    assert same(r, back)
    assert back.tensors["d"].stride() == (0, 0)
    full = encode(Record("state", key(1), dict(t, d=torch.full((8, 16), float("-inf")))), ID)
    assert len(full) - len(data) >= 8 * 16 * 4 - 8      # the fill tensor costs a few header bytes


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "extend", "empty"])
def test_damaged_entries_are_rejected(damage):
    data = bytearray(encode(rec(2), ID))
    if damage == "flip-payload":
        data[-10] ^= 0x40
    elif damage == "flip-header":
        data[60] ^= 0x01
    elif damage == "truncate":
        data = data[:len(data) // 2]
    elif damage == "extend":
        data += b"\0"
    else:
        data = bytearray()
    with pytest.raises(CacheEntryError):
        decode(data, ID, "block", key(2))


def forged(header, payload: bytes = b"") -> bytearray:
    """An entry whose digest holds over a header that is not what `encode` writes: what anyone who
    can write the directory or the Redis keys can plant (the digest is not keyed)."""
    import json
    import struct

    from hybridkv.cache.tiers.record import MAGIC
    h = json.dumps(header).encode()
    body = struct.pack("<I", len(h)) + h + payload
    return bytearray(MAGIC + hashlib.sha256(body).digest() + body)


GOOD_HEAD = {"version": 1, "kind": "block", "key": key(5).hex(), "identity": ID, "created": 0.0, "payload": 0,
             "tensors": []}


@pytest.mark.parametrize("header", [[], "text", 7, dict(GOOD_HEAD, payload="x"), dict(GOOD_HEAD, payload=None),
                                    dict(GOOD_HEAD, created="yesterday"), dict(GOOD_HEAD, tensors=5),
                                    dict(GOOD_HEAD, tensors=[{"name": "a", "dtype": "float32", "shape": [-1],
                                                              "offset": 0, "nbytes": 0}]),
                                    dict(GOOD_HEAD, tensors=[{"name": "a", "dtype": "int64", "shape": [1]}])],
                         ids=["list", "string", "number", "payload-text", "payload-null", "created-text",
                              "tensors-number", "negative-shape", "unknown-dtype"])
def test_entries_with_an_intact_digest_but_a_malformed_header_are_rejected(header):
    with pytest.raises(CacheEntryError):
        decode(forged(header), ID, "block", key(5))


def test_foreign_and_misplaced_entries_are_rejected():
    data = bytearray(encode(rec(3), ID))
    with pytest.raises(CacheEntryError, match="identity"):
        decode(data, "another-model", "block", key(3))
    with pytest.raises(CacheEntryError, match="wrong key"):
        decode(data, ID, "block", key(4))
    with pytest.raises(CacheEntryError, match="wrong key"):
        decode(data, ID, "state", key(3))


def test_config_parsing():
    assert parse_lifetimes("block=72h,state=10m", {}) == {"block": 72 * H, "state": 600.0}
    assert parse_lifetimes("30s", {}) == {"block": 30.0, "state": 30.0}
    assert parse_lifetimes(".5h", {}) == {"block": 1800.0, "state": 1800.0}
    assert TierConfig(disk_bytes="1.5G").disk_bytes == 3 << 29
    c = TierConfig(dram_bytes="512M", disk_dir="", disk_lifetime="state=0")
    assert c.dram_bytes == 512 << 20 and c.disk_dir is None and c.disk_lifetime == {"block": 72 * H, "state": 0}
    for bad in (dict(write_policy="sometimes"), dict(dram_ttl="window=3m"), dict(redis_url="http://x"),
                dict(disk_bytes="lots"), dict(disk_bytes="1.2.3G"), dict(disk_bytes="."), dict(dram_ttl="1..5h")):
        with pytest.raises(ConfigError):
            TierConfig(**bad)


# ----- DRAM -----
def test_dram_ttl_per_kind_with_clock():
    clock = Clock()
    d = DramTier(1 << 20, {"block": 72 * H, "state": 600}, clock)
    d.put(rec(1, "block"))
    d.put(rec(2, "state"))
    clock.t += 500
    assert d.get(key(2), "state") is not None           # a use refreshes the TTL
    clock.t += 599
    assert d.contains(key(2), "state")
    clock.t += 2
    assert d.get(key(2), "state") is None and d.stats.expired == 1
    clock.t += 71 * H
    assert d.get(key(1), "block") is not None
    clock.t += 72 * H + 1
    assert d.get(key(1), "block") is None and d.stats.expired == 2 and d.stats.bytes == 0


def test_dram_evicts_least_recently_used():
    size = rec(0).nbytes
    d = DramTier(3 * size, {"block": H, "state": H}, Clock())
    for i in range(3):
        d.put(rec(i))
    assert d.get(key(0), "block") is not None           # 0 becomes the most recent
    d.put(rec(3))                                        # evicts 1, the least recently used
    assert [d.contains(key(i), "block") for i in range(4)] == [True, False, True, True]
    d.put(rec(4))
    assert [d.contains(key(i), "block") for i in range(5)] == [True, False, False, True, True]
    assert d.stats.evictions == 2 and d.stats.evicted_bytes == 2 * size and d.stats.bytes == 3 * size


# ----- disk -----
def disk(path, clock=None, capacity=1 << 30, ttl=None, identity=ID):
    return DiskTier(path, capacity, ttl or {"block": 72 * H, "state": 600}, identity, clock or Clock())


def entry_files(path):
    return sorted(Path(path).rglob("*.kv"))


def test_disk_survives_restart(tmp_path):
    d = disk(tmp_path)
    for i in range(5):
        d.put(rec(i))
    d.put(rec(9, "state"))
    again = disk(tmp_path)                               # a new process: index rebuilt from the directory
    assert again.stats.entries == 6 and again.stats.bytes == d.stats.bytes
    for i in range(5):
        assert same(again.get(key(i), "block"), rec(i))
    assert same(again.get(key(9), "state"), rec(9, "state"))
    assert again.get(key(9), "block") is None            # kinds are separate


def test_disk_lifetimes_with_clock_survive_restart(tmp_path):
    clock = Clock()
    d = disk(tmp_path, clock)
    d.put(rec(1, "block"))
    d.put(rec(2, "state"))
    clock.t += 601
    assert d.get(key(2), "state") is None and d.stats.expired == 1   # short-lived state is gone
    assert not any("state" in str(p) for p in entry_files(tmp_path))
    clock.t += 71 * H
    restarted = disk(tmp_path, clock)                    # last use is the file's mtime
    assert restarted.get(key(1), "block") is not None    # used at 71h10m: refreshed
    clock.t += 72 * H + 1
    restarted = disk(tmp_path, clock)                    # start-up sweeps expired entries
    assert restarted.stats.expired == 1 and entry_files(tmp_path) == []


def test_disk_size_limit_evicts_lru(tmp_path):
    clock = Clock()
    size = len(encode(rec(0), ID))
    d = disk(tmp_path, clock, capacity=3 * size)
    for i in range(3):
        d.put(rec(i))
        clock.t += 1
    d.get(key(0), "block")
    clock.t += 1
    d.put(rec(3))
    assert [d.contains(key(i), "block") for i in range(4)] == [True, False, True, True]
    assert d.stats.evictions == 1 and len(entry_files(tmp_path)) == 3
    restarted = disk(tmp_path, clock, capacity=2 * size)   # the LRU order survives a restart (mtimes)
    assert [restarted.contains(key(i), "block") for i in range(4)] == [True, False, False, True]


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "foreign", "garbage", "forged-header", "oversized"])
def test_disk_bad_entries_are_removed_and_others_kept(tmp_path, damage, caplog):
    """A bad entry is a miss and is removed; the others load. "oversized": a file larger than the
    tier's capacity, never read into memory."""
    d = disk(tmp_path)
    for i in range(3):
        d.put(rec(i))
    path = d._path("block", d._name(key(1)))
    if damage == "corrupt":
        b = bytearray(path.read_bytes())
        b[len(b) // 2] ^= 0xFF
        path.write_bytes(bytes(b))
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "foreign":                            # a valid entry of another model under our name
        path.write_bytes(encode(rec(1), "another-model"))
    elif damage == "forged-header":
        path.write_bytes(bytes(forged([])))
    elif damage == "oversized":             # grown after a tier of 1 MiB opened the directory
        fresh = disk(tmp_path, capacity=1 << 20)
        with open(path, "r+b") as f:
            f.truncate(2 << 20)
    else:
        path.write_bytes(os.urandom(5000))
    if damage != "oversized":
        fresh = disk(tmp_path)
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        assert fresh.get(key(1), "block") is None
    assert fresh.stats.bad == 1 and not path.exists() and "removed" in caplog.text
    assert same(fresh.get(key(0), "block"), rec(0)) and same(fresh.get(key(2), "block"), rec(2))


def test_two_engines_share_one_directory(tmp_path):
    """Two tiers (as two engines would) write overlapping entries at once; every entry stays whole."""
    a, b = disk(tmp_path), disk(tmp_path)
    errors = []

    def writer(tier, ids):
        try:
            for i in ids:
                tier.put(rec(i, n=20000))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=writer, args=(a, range(0, 30))),
               threading.Thread(target=writer, args=(b, range(15, 45)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    reader = disk(tmp_path)
    assert reader.stats.entries == 45
    assert all(same(reader.get(key(i), "block"), rec(i, n=20000)) for i in range(45))
    assert a.contains(key(40), "block")                  # one engine sees what the other wrote


def test_engines_of_other_models_lifetimes_and_sizes_leave_each_others_entries(tmp_path, caplog):
    """One directory, several engines: another model's engine, one that keeps no state (lifetime 0) and
    one with a tiny size limit remove none of the entries they do not own or keep."""
    clock = Clock()
    a = disk(tmp_path, clock, ttl={"block": 72 * H, "state": H})
    for i in range(3):
        a.put(rec(i))
        a.put(rec(10 + i, "state"))
    other_model = disk(tmp_path, clock, capacity=1, ttl={"block": 1.0, "state": 1.0}, identity="identity-b")
    clock.t += 60                                        # past every lifetime of the other model's engine
    other_model.put(rec(7))
    other_model.sweep()
    assert other_model.stats.entries == 0                # its own entry went (size limit 1 byte)
    no_state = disk(tmp_path, clock, ttl={"block": 72 * H, "state": 0})
    no_state.sweep()
    assert no_state.stats.expired == 0
    again = disk(tmp_path, clock, ttl={"block": 72 * H, "state": H})
    assert again.stats.entries == 6
    assert all(same(again.get(key(i), "block"), rec(i)) for i in range(3))
    assert all(same(again.get(key(10 + i), "state"), rec(10 + i, "state")) for i in range(3))
    # engines of one model share its entries and its size limit
    small = disk(tmp_path, clock, capacity=2 * again.stats.bytes // 6)
    assert small.stats.entries == 2 and small.stats.evictions == 4


def test_a_directory_removed_under_the_engine_is_made_again(tmp_path):
    import shutil

    clock = Clock()
    d = disk(tmp_path, clock)
    d.put(rec(1))
    shutil.rmtree(tmp_path / "hybridkv-kv-v2")
    d.put(rec(2))
    assert d.stats.errors == 0 and d.stats.stored == 2
    assert same(disk(tmp_path, clock).get(key(2), "block"), rec(2))


def test_an_earlier_layout_is_named_and_left_alone(tmp_path, caplog):
    old = tmp_path / "hybridkv-kv-v1" / "block" / "ab" / "x.kv"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an entry of the former layout")
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        disk(tmp_path).sweep()
    assert "hybridkv-kv-v1 holds entries of an earlier layout" in caplog.text and old.exists()


KILL_CHILD = textwrap.dedent("""
    import os, sys, time, hashlib
    sys.path.insert(0, sys.argv[3])
    import torch
    from hybridkv.cache.tiers.disk import DiskTier
    from hybridkv.cache.tiers.record import Record
    tier = DiskTier(sys.argv[1], 1 << 30, {"block": 1e9, "state": 1e9}, "identity-a")
    def rec(i):
        return Record("block", hashlib.sha256(str(i).encode()).digest(),
                      {"0.kv": torch.full((400_000,), float(i))})
    if sys.argv[2] == "pause":
        tier.put(rec(0))
        real = os.write
        def half_then_wait(fd, data):
            n = real(fd, bytes(data[:len(data) // 2]))
            open(os.path.join(sys.argv[1], "ready"), "w").close()
            time.sleep(60)
            return n
        os.write = half_then_wait
        tier.put(rec(1))
    else:
        i = 0
        while True:
            tier.put(rec(i % 50)); i += 1
            if i == 3:
                open(os.path.join(sys.argv[1], "ready"), "w").close()
""")


def _start_child(tmp_path, mode):
    script = tmp_path / "child.py"
    script.write_text(KILL_CHILD)
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache"), mode, str(ROOT)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def _wait_ready(tmp_path, proc):
    deadline = time.monotonic() + 60
    while not (tmp_path / "cache" / "ready").exists():
        assert proc.poll() is None, "the writer died before it was ready"
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_sigkill_in_the_middle_of_a_write_leaves_nothing_loadable(tmp_path):
    proc = _start_child(tmp_path, "pause")
    _wait_ready(tmp_path, proc)                          # half of entry 1 is on disk, in a temp file
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    tmps = list((tmp_path / "cache").rglob("*.tmp"))
    assert len(tmps) == 1 and 0 < tmps[0].stat().st_size
    d = DiskTier(tmp_path / "cache", 1 << 30, {"block": 1e9, "state": 1e9}, ID)
    assert not list((tmp_path / "cache").rglob("*.tmp"))  # the dead writer's temp file is removed on start
    assert d.get(key(1), "block") is None and d.stats.bad == 0
    assert torch.equal(d.get(key(0), "block").tensors["0.kv"], torch.full((400_000,), 0.0))


def test_sigkill_at_random_moments_never_leaves_a_bad_entry(tmp_path):
    for delay in (0.0, 0.02, 0.05):
        proc = _start_child(tmp_path, "loop")
        _wait_ready(tmp_path, proc)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        (tmp_path / "cache" / "ready").unlink()
    d = DiskTier(tmp_path / "cache", 1 << 30, {"block": 1e9, "state": 1e9}, ID)
    files = entry_files(tmp_path / "cache")
    assert files and d.stats.entries == len(files)
    for i in range(50):
        r = d.get(key(i), "block")
        assert r is None or torch.equal(r.tensors["0.kv"], torch.full((400_000,), float(i)))
    assert d.stats.bad == 0 and d.stats.hits == len(files)


def test_unwritable_directory_degrades_with_a_warning(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        d = disk(blocker / "cache")
        d.put(rec(1))
    assert "persistence is paused" in caplog.text and d.stats.dropped == 1
    assert d.get(key(1), "block") is None


def test_full_disk_pauses_writes_then_retries(tmp_path, monkeypatch, caplog):
    import errno

    clock = Clock()
    d = disk(tmp_path, clock)
    real = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "write", full)
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        d.put(rec(1))
    assert "the disk is full" in caplog.text and d.stats.errors == 1
    assert not list(tmp_path.rglob("*.tmp")) and entry_files(tmp_path) == []
    monkeypatch.setattr(os, "write", real)
    d.put(rec(2))
    assert d.stats.dropped == 2 and entry_files(tmp_path) == []   # paused
    clock.t += 61
    d.put(rec(3))
    assert d.get(key(3), "block") is not None


# ----- Redis -----
def test_redis_round_trip_native_ttl_and_refresh(redis_url):
    r = RedisTier(redis_url, {"block": 72 * H, "state": 2.0}, ID, prefix="t1")
    r.put(rec(1))
    r.put(rec(2, "state"))
    assert same(r.get(key(1), "block"), rec(1))
    pttl = r.client.pttl(r._k("block", key(1)))
    assert 72 * H * 1000 - 5000 < pttl <= 72 * H * 1000
    assert r.contains_many([key(1), key(2), key(3)], "block") == [True, False, False]
    # read Redis's own clock (PTTL) rather than trusting sleeps, which a loaded machine stretches
    time.sleep(0.5)
    before = r.client.pttl(r._k("state", key(2)))
    assert 0 < before <= 1500
    assert r.get(key(2), "state") is not None           # a hit refreshes the TTL (GETEX)
    assert r.client.pttl(r._k("state", key(2))) > before
    deadline = time.monotonic() + 10
    while r.contains(key(2), "state"):                  # Redis expires it (~2 s after the hit)
        assert time.monotonic() < deadline, "the state entry never expired"
        time.sleep(0.05)
    assert r.get(key(2), "state") is None
    other = RedisTier(redis_url, {"block": H, "state": H}, ID, prefix="t1")   # another engine, same pool
    assert same(other.get(key(1), "block"), rec(1))


def test_redis_bad_values_are_removed(redis_url):
    r = RedisTier(redis_url, {"block": H, "state": H}, ID, prefix="t2")
    r.put(rec(1))
    r.put(rec(2))
    k1 = r._k("block", key(1))
    r.client.set(k1, r.client.get(k1)[:-7])                                    # truncated
    r.client.set(r._k("block", key(2)), encode(rec(2), "another-model"))       # foreign
    assert r.get(key(1), "block") is None and r.get(key(2), "block") is None
    assert r.stats.bad == 2 and not r.client.exists(k1)
    foreign = RedisTier(redis_url, {"block": H, "state": H}, "another-model", prefix="t2")
    foreign.put(rec(5))
    assert r.get(key(5), "block") is None and foreign.get(key(5), "block") is not None   # separate namespaces


def test_redis_down_degrades(caplog):
    from redis_server import free_port

    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        r = RedisTier(f"redis://127.0.0.1:{free_port()}/0", {"block": H, "state": H}, ID, timeout=0.2)
        r.put(rec(1))
        assert r.get(key(1), "block") is None and r.contains_many([key(1)], "block") == [False]
    assert "requests go on" in caplog.text and r.stats.errors == 1 and r.stats.dropped == 1


# ----- the chain -----
def test_chain_promotes_lower_hits(tmp_path, redis_url):
    cfg = TierConfig(disk_dir=str(tmp_path), redis_url=redis_url, redis_prefix="t3")
    s = TieredStore.build(cfg, ID)
    s.put(rec(1))
    assert s.flush(30)
    assert all(t.contains(key(1), "block") for t in s.tiers)
    # a new engine on another machine: empty DRAM, another disk, the shared Redis
    s2 = TieredStore.build(TierConfig(disk_dir=str(tmp_path / "other"), redis_url=redis_url, redis_prefix="t3"), ID)
    assert s2.present([key(1), key(2)], "block") == [True, False]
    assert same(s2.get(key(1), "block"), rec(1))
    assert s2.flush(30)
    assert s2.tier("dram").contains(key(1), "block") and s2.tier("disk").contains(key(1), "block")
    st = s2.stats()
    assert st["redis"]["hits"] == 1 and st["dram"]["stored"] == 1 and st["disk"]["stored"] == 1
    s.close()
    s2.close()


def test_chain_usage_per_tier(tmp_path, redis_url):
    """usage(): what DRAM and disk hold with their capacities and counters; Redis reports its
    server's maxmemory and leaves out holdings it cannot know (other engines share it)."""
    s = TieredStore.build(TierConfig(dram_bytes=1 << 24, disk_dir=str(tmp_path), redis_url=redis_url,
                                     redis_prefix="t4"), ID)
    s.put(rec(1))
    assert s.flush(30)
    assert s.get(key(1), "block") is not None and s.get(key(2), "block") is None
    u = s.usage()
    assert list(u) == ["dram", "disk", "redis"]
    size = rec(1).nbytes
    assert (u["dram"]["bytes"], u["dram"]["entries"], u["dram"]["capacity"], u["dram"]["hits"]) == (size, 1, 1 << 24, 1)
    assert u["disk"]["bytes"] > size and u["disk"]["entries"] == 1 and u["disk"]["capacity"] == 16 << 30
    assert u["disk"]["hits"] == 0 and u["dram"]["misses"] == 1 and u["disk"]["misses"] == 1
    assert u["redis"]["capacity"] == 256 << 20 and u["redis"]["bytes"] is None and u["redis"]["entries"] is None
    assert u["redis"]["stored"] == 1
    s.close()


def test_a_collected_store_has_ended_its_writer_thread():
    """A store dropped without close() finishes its queued writes and ends the writer thread before
    the collection returns (a writer still ending at process exit aborted the process on CUDA)."""
    import gc

    s = TieredStore.build(TierConfig(dram_bytes=1 << 24), ID)
    for i in range(4):
        s.put(rec(i))
    dram = s.tier("dram")
    writer = s._writer.thread
    assert writer is not None and writer.is_alive()
    del s
    gc.collect()
    assert not writer.is_alive()
    assert all(dram.contains(key(i), "block") for i in range(4))
