"""The prefix-cache tiers below the device in /metrics, /stats and the web page's data: after a
prefix is written to host DRAM and a disk directory and then served from them, each tier reports
non-zero bytes and hits; a DRAM tier smaller than a request's records counts its evictions."""

import random
import time

import httpx
import pytest

from hybridkv.cache.tiers import TierConfig

BLOCK = 128


def ids(n: int, seed: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(2, 512) for _ in range(n)]


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridkv:kv_tier_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def series(name: str, tier: str) -> str:
    return f'hybridkv:kv_tier_{name}{{model_name="tiny",tier="{tier}"}}'


def wait_for(fn, what: str, timeout: float = 20.0):
    deadline = time.time() + timeout
    while not (value := fn()):
        if time.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
    return value


def complete(server, prompt: list[int]) -> dict:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def serve_from_lower_tiers(server) -> dict:
    """A prefix written through to the tiers, pushed off the device by a prompt that needs every
    block, then asked for again: its blocks come back from below. Returns the last usage."""
    prefix = ids(3 * BLOCK - 20, seed=1)
    complete(server, prefix)
    wait_for(lambda: server.stats()["memory"]["lower_tiers"]["disk"]["entries"] >= 4,
             "the prefix's blocks and states on disk")
    complete(server, ids(7 * BLOCK + 60, seed=2))       # takes all 8 device blocks
    assert server.engine.store.pool.evictions >= 2
    again = complete(server, prefix)
    assert again["prompt_tokens_details"]["cached_tokens"] == 2 * BLOCK
    server.wait_idle()
    return again


def make(tmp_path, dram_bytes):
    from serverkit import LiveServer

    tiers = TierConfig(dram_bytes=dram_bytes, disk_dir=str(tmp_path / "kv"))
    return LiveServer(num_blocks=8, max_num_seqs=1, max_num_batched_tokens=1024, tiers=tiers)


@pytest.fixture()
def server(tmp_path):
    s = make(tmp_path, 1 << 30)
    yield s
    s.close()


def test_dram_and_disk_tiers_report_bytes_and_hits(server):
    before = metrics(server)
    assert before[series("bytes", "dram")] == 0 and before[series("capacity_bytes", "dram")] == 1 << 30
    assert before[series("hits_total", "disk")] == 0
    serve_from_lower_tiers(server)
    m = wait_for(lambda: (m := metrics(server))[series("hits_total", "dram")] >= 2 and m, "DRAM hits in /metrics")
    for tier in ("dram", "disk"):
        assert m[series("bytes", tier)] > 0 and m[series("entries", tier)] >= 4
        assert m[series("stored_bytes_total", tier)] >= m[series("bytes", tier)] > 0
    assert m[series("loaded_bytes_total", "dram")] > 0
    assert m[series("hits_total", "disk")] == 0      # DRAM had every block: the disk was not asked
    assert m[series("evictions_total", "dram")] == 0
    # /stats carries the same numbers for the web page
    dram = server.stats()["memory"]["lower_tiers"]["dram"]
    assert dram["bytes"] == m[series("bytes", "dram")] and dram["capacity"] == 1 << 30 and dram["hits"] >= 2
    assert "<h3>Prefix-cache tiers below the device</h3>" in httpx.get(server.url + "/").text


def test_a_tiny_dram_tier_evicts_and_the_disk_serves(tmp_path):
    server = make(tmp_path, 400_000)       # less than a block record and a window-state record together
    try:
        serve_from_lower_tiers(server)
        m = wait_for(lambda: (m := metrics(server))[series("hits_total", "disk")] >= 1 and m, "disk hits")
        assert m[series("evictions_total", "dram")] >= 2 and m[series("evicted_bytes_total", "dram")] > 0
        assert 0 < m[series("bytes", "dram")] <= 400_000
        assert m[series("misses_total", "dram")] >= 1        # asked first, then the disk had it
        assert m[series("bytes", "disk")] > 0
        stats = server.stats()["memory"]["lower_tiers"]
        assert list(stats) == ["dram", "disk"] and stats["dram"]["evictions"] == m[series("evictions_total", "dram")]
    finally:
        server.close()


def test_a_server_without_lower_tiers_reports_none(tmp_path):
    from serverkit import LiveServer

    server = LiveServer(num_blocks=8, max_num_seqs=1, tiers=TierConfig(dram_bytes=0))
    try:
        assert server.stats()["memory"]["lower_tiers"] == {} and metrics(server) == {}
    finally:
        server.close()


def test_stopping_the_server_writes_the_queued_records_and_closes_the_tiers(tmp_path):
    """The engine thread closes the engine when the server stops: the disk tier's queued writes are
    on disk and the tiers are released, and no request is left without an answer."""
    server = make(tmp_path, 0)
    try:
        complete(server, ids(3 * BLOCK - 20, seed=3))
    finally:
        server.close()
    assert not server.driver.alive and server.engine.tiers._closed
    records = [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and not p.name.endswith(".tmp")]
    assert len(records) >= 3, records          # the prompt's two full blocks and its window state at least


def snapshot_counts(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridkv:prefix_snapshots_total"):
            name, value = line.rsplit(" ", 1)
            out[name.split('event="')[1].split('"')[0]] = float(value)
    return out


@pytest.mark.parametrize("dram_bytes", [0, 1 << 30])
def test_snapshots_taken_for_the_tiers_alone_or_not_at_all_are_counted(dram_bytes):
    """With room on the device for one window-state snapshot, a 364-token prompt run as one chunk
    passes two block boundaries: the newer (256) is kept on the device, the older (128) goes to the
    DRAM tier alone or, without tiers, is not taken; /metrics and /stats count each."""
    from serverkit import LiveServer

    server = LiveServer(num_blocks=8, max_num_seqs=1, max_num_batched_tokens=1024,
                        tiers=TierConfig(dram_bytes=dram_bytes))
    try:
        size = server.engine.snapshot_nbytes
        server.engine.prefix.snapshots.capacity = size + size // 2
        complete(server, ids(3 * BLOCK - 20, seed=4))
        server.wait_idle()
        below, skipped = (1, 0) if dram_bytes else (0, 1)
        assert snapshot_counts(server) == {"stored": 1, "evicted": 0, "below": below, "skipped": skipped}
        stats = server.stats()["memory"]["snapshots"]
        assert (stats["below"], stats["skipped"], stats["bytes_each"]) == (below, skipped, size)
        if dram_bytes:
            wait_for(lambda: server.stats()["memory"]["lower_tiers"]["dram"]["entries"] >= 4,
                     "two blocks and two states in DRAM")
    finally:
        server.close()
