"""The engine with its lower tiers: restarts that hit from disk or Redis and match a cold run, a
lower-tier hit that restores exactly what a device hit has (each window policy), write policies,
lifetimes by kind, and bad or unusable storage that never changes an output."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_helpers import prompts_of, rel

from hybridkv.engine import LLM, SamplingParams

CHILD = Path(__file__).parent / "tiers_child.py"


@pytest.fixture(scope="module", params=["v4-tiny", "v41-tiny"])
def tiny_dir(fixtures, request):
    """The tier tests run on a V4 and a V4.1 checkpoint (V4.1 stores only its source layers' KV)."""
    return fixtures / request.param


@pytest.fixture(scope="module")
def base_extra():
    return prompts_of([700, 90], seed=21)


@pytest.fixture(scope="module")
def cold(tiny_dir, base_extra):
    """base + extra computed from scratch (no prefix cache)."""
    base, extra = base_extra
    return run(make(tiny_dir, enable_prefix_caching=False), base + extra)


def make(tiny_dir, **kw):
    opts = dict(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=256)
    opts.update(kw)
    llm = LLM(tiny_dir, **opts)
    llm.engine.record_logits = True
    return llm


def run(llm, prompt, max_tokens=6):
    seq = llm.engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))
    while llm.engine.has_unfinished():
        llm.engine.step()
    return seq


def child(tmp_path, name, tiny_dir, prompts, engine, fsize_limit=None):
    spec = tmp_path / f"{name}.json"
    spec.write_text(json.dumps({"model": str(tiny_dir), "prompts": prompts, "max_tokens": 6, "engine": engine,
                                "fsize_limit": fsize_limit}))
    out = tmp_path / f"{name}.pt"
    p = subprocess.run([sys.executable, str(CHILD), str(spec), str(out)], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert p.returncode == 0, p.stderr
    return torch.load(out), p.stderr


def assert_matches_cold(ids, logits, cold):
    assert ids == cold.output_ids
    for got, want in zip(logits, cold.step_logits):
        assert rel(got, want) <= 1e-4


@pytest.mark.parametrize("where", ["disk", "redis"])
def test_restart_hits_and_matches_a_cold_run(tmp_path, tiny_dir, base_extra, cold, where, request):
    """Engine A serves a long prompt and exits; engine B, a new process, hits it from disk (or
    Redis) and its greedy output and logits match a cold run (full policy)."""
    if where == "disk":
        tiers = {"dram_bytes": 0, "disk_dir": str(tmp_path / "kv")}
    else:
        tiers = {"dram_bytes": 0, "redis_url": request.getfixturevalue("redis_url"), "redis_prefix": "restart"}
    base, extra = base_extra
    a, _ = child(tmp_path, "a", tiny_dir, [base], {"tiers": tiers})
    assert a["cached"] == [0] and a["stats"][where]["stored"] == 10      # 5 blocks + 5 snapshots
    b, _ = child(tmp_path, "b", tiny_dir, [base + extra], {"tiers": tiers})
    assert b["cached"] == [640]
    assert b["stats"][where]["hits"] == 6 and b["stats"]["device"]["loaded"] == 5
    assert_matches_cold(b["ids"][0], b["logits"][0], cold)


@pytest.mark.parametrize("policy,tier,fmt", [("full", "dram", "native"), ("checkpoint(256)", "disk", "native"),
                                             ("zero", "disk", "native"), ("full", "disk", "fp8"),
                                             ("full", "disk", "v41"), ("zero", "dram", "v41")])
def test_lower_tier_hit_restores_exactly_a_device_hit(tmp_path, fixtures, base_extra, policy, tier, fmt):
    base, extra = base_extra
    tiny_dir = fixtures / {"fp8": "v4-tiny-fp8", "v41": "v41-tiny-fp8"}.get(fmt, "v4-tiny")
    device = make(tiny_dir, window_policy=policy, kv_format=fmt, tiers={"dram_bytes": 0})
    run(device, base)
    want = run(device, base + extra)                                  # a device hit
    tiers = {"dram_bytes": 1 << 30} if tier == "dram" else {"dram_bytes": 0, "disk_dir": str(tmp_path)}
    llm = make(tiny_dir, window_policy=policy, kv_format=fmt, tiers=tiers)
    run(llm, base)
    llm.engine.tiers.flush()
    llm.engine.prefix.clear_device()
    got = run(llm, base + extra)                                      # the same hit, from the lower tier
    assert got.num_cached_tokens == want.num_cached_tokens > 0
    assert got.num_replayed_tokens == want.num_replayed_tokens == (128 if policy == "zero" else 0)
    assert got.output_ids == want.output_ids
    assert all(torch.equal(a, b) for a, b in zip(got.step_logits, want.step_logits))
    stats = llm.engine.cache_stats()
    assert stats[tier]["hits"] >= 5 and stats["device"]["loaded"] == 5 and stats["device"]["hits"] == 0
    llm.engine.store.pool.check()


def test_a_chunk_takes_only_the_snapshots_some_store_has_room_for(tiny_dir, base_extra):
    """A 700-token prompt in one chunk passes the boundaries 128 … 640. With a device budget of two
    snapshots and a tier writer with room for three (after the chunk's five blocks), the newest two
    (512, 640) are kept on the device and written through, the oldest (128) goes to the tiers alone
    and 256 and 384 are not taken. Each snapshot taken equals, to the bit, the one an engine with
    room for all takes; the outputs are the same; a prompt that shares only the first 200 tokens
    hits at 128 from the tier, as it does from the other engine's device store."""
    base, _ = base_extra
    other = base[:200] + prompts_of([150], seed=5)[0]
    ample = make(tiny_dir, max_num_batched_tokens=1024, tiers={"dram_bytes": 0})
    want = run(ample, base)
    eng = ample.engine
    size = eng.snapshot_nbytes
    assert [s for _, s in eng.prefix.snapshots._items.values()] == [size] * 5
    want_snaps = {k: snap for k, (snap, _) in eng.prefix.snapshots._items.items()}
    want_other = run(ample, other)

    block = sum(eng.store.block_bytes().values()) + 4 * eng.store.block_tokens
    llm = make(tiny_dir, max_num_batched_tokens=1024, snapshot_bytes=2 * size + size // 2,
               tiers={"dram_bytes": 1 << 30, "max_pending_bytes": 5 * block + 3 * size + size // 2})
    got = run(llm, base)
    llm.engine.tiers.flush()
    hashes = got.block_hashes
    assert got.output_ids == want.output_ids
    assert all(torch.equal(a, b) for a, b in zip(got.step_logits, want.step_logits))
    prefix = llm.engine.prefix
    assert list(prefix.snapshots._items) == [hashes[3], hashes[4]]
    assert (prefix.snapshots_below, prefix.snapshots_skipped) == (1, 2)
    dram = llm.engine.tiers.tier("dram")
    in_tier = [b for b in range(5) if dram.contains(hashes[b], "state")]
    assert in_tier == [0, 3, 4]
    for b in in_tier:
        rec = dram.get(hashes[b], "state")
        flat = [t for layer in want_snaps[hashes[b]] for t in layer]
        assert len(rec.tensors) == len(flat)
        for i, (layer, ts) in enumerate((n, ts) for n, ts in enumerate(want_snaps[hashes[b]])):
            for j, t in enumerate(ts):
                assert torch.equal(rec.tensors[f"{layer}.{j}"], t), (b, layer, j)
    assert llm.engine.cache_stats()["writer"]["dropped"] == 0

    hit = run(llm, other)
    assert hit.num_cached_tokens == want_other.num_cached_tokens == 128
    assert hit.output_ids == want_other.output_ids
    assert all(torch.equal(a, b) for a, b in zip(hit.step_logits, want_other.step_logits))
    llm.engine.store.pool.check()


def test_what_is_stored_follows_the_policy_and_write_policy(tmp_path, tiny_dir, base_extra):
    base, _ = base_extra
    stored = {}
    for policy in ("full", "checkpoint(256)", "zero"):
        llm = make(tiny_dir, window_policy=policy, tiers={"disk_dir": str(tmp_path / policy),
                                                          "write_policy": "request_end"})
        seq = llm.engine.add_request(base, SamplingParams(max_tokens=6))
        for _ in range(3):
            llm.engine.step()                                         # 768 of 700 + 6 tokens scheduled
        llm.engine.tiers.flush()
        assert seq.num_computed >= 512 and llm.engine.cache_stats()["disk"]["stored"] == 0
        while llm.engine.has_unfinished():
            llm.engine.step()
        llm.close()
        stored[policy] = llm.engine.cache_stats()["disk"]["stored"]
    # 5 blocks each; states: every boundary / 256, 512 and the request's last boundary 640 / none
    assert stored == {"full": 10, "checkpoint(256)": 8, "zero": 5}


def test_short_lived_state_expires_before_long_lived_blocks(tiny_dir, base_extra):
    base, extra = base_extra
    for policy, expect in (("full", 0), ("zero", 640)):
        llm = make(tiny_dir, window_policy=policy)                     # default: DRAM tier only
        dram = llm.engine.tiers.tier("dram")
        now = [1000.0]
        dram.clock = lambda: now[0]
        run(llm, base)
        llm.engine.tiers.flush()
        llm.engine.prefix.clear_device()
        now[0] += 601                                                 # past the state TTL, within 72 h
        hit = run(llm, base + extra)
        assert hit.num_cached_tokens == expect
        assert dram.stats.expired == (5 if policy == "full" else 0)


def test_corrupted_disk_entries_are_never_loaded(tmp_path, tiny_dir, base_extra, cold, caplog):
    base, extra = base_extra
    tiers = {"dram_bytes": 0, "disk_dir": str(tmp_path)}
    a = make(tiny_dir, tiers=tiers)
    run(a, base)
    a.close()
    files = sorted(tmp_path.rglob("*.kv"))
    assert len(files) == 10
    for i, f in enumerate(files):                                     # damage every entry, three ways
        data = bytearray(f.read_bytes())
        if i % 3 == 0:
            data[len(data) // 3] ^= 0x10
        elif i % 3 == 1:
            data = data[:len(data) - 1]
        else:
            data[40:48] = b"\0" * 8
        f.write_bytes(bytes(data))
    b = make(tiny_dir, tiers=tiers)
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        hit = run(b, base + extra)
    assert hit.num_cached_tokens == 0
    assert_matches_cold(hit.output_ids, hit.step_logits, cold)
    assert b.engine.cache_stats()["disk"]["bad"] >= 1 and "removed" in caplog.text
    b.close()
    c = make(tiny_dir, tiers=tiers)                  # b's recomputed blocks replaced the damaged files
    again = run(c, base + extra)
    assert again.num_cached_tokens == 768 and c.engine.cache_stats()["disk"]["bad"] == 0
    assert again.output_ids == cold.output_ids


def test_a_forged_entry_with_a_valid_checksum_is_refused_before_its_tokens_are_read(tmp_path, tiny_dir, base_extra,
                                                                                  cold, caplog):
    """A block entry rewritten (checksum and all) with token ids declared as a fill tensor of 2^40
    elements costs its header, not terabytes: it is refused as a bad entry and the block recomputed."""
    from hybridkv.cache.tiers.record import Record, decode, encode

    base, extra = base_extra
    tiers = {"dram_bytes": 0, "disk_dir": str(tmp_path)}
    a = make(tiny_dir, tiers=tiers)
    run(a, base)
    a.close()
    for f in sorted(tmp_path.rglob("block/*/*.kv")):
        raw = f.read_bytes()
        head = json.loads(raw[44:44 + int.from_bytes(raw[40:44], "little")])
        rec = decode(raw, head["identity"], "block", bytes.fromhex(head["key"]))
        rec.tensors["tokens"] = torch.zeros(1, dtype=torch.int32).expand(1 << 40)
        f.write_bytes(encode(Record("block", rec.key, rec.tensors), head["identity"]))
    b = make(tiny_dir, tiers=tiers)
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        hit = run(b, base + extra)
    assert hit.num_cached_tokens == 0 and b.engine.cache_stats()["disk"]["bad"] >= 1
    assert "token ids are torch.int32[1099511627776]" in caplog.text
    assert_matches_cold(hit.output_ids, hit.step_logits, cold)
    b.close()


def test_unwritable_directory_keeps_serving(tmp_path, tiny_dir, base_extra, cold, caplog):
    base, extra = base_extra
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="hybridkv.cache.tiers"):
        llm = make(tiny_dir, tiers={"disk_dir": str(tmp_path / "file" / "kv")})
        run(llm, base)
        hit = run(llm, base + extra)
    assert "persistence is paused" in caplog.text
    assert hit.num_cached_tokens == 640                                # the device and DRAM still serve
    assert_matches_cold(hit.output_ids, hit.step_logits, cold)


def test_full_disk_keeps_serving(tmp_path, tiny_dir, base_extra, cold):
    """A process whose file writes fail past 4 KiB (a full disk): a warning, no persistence,
    the same outputs."""
    base, extra = base_extra
    out, err = child(tmp_path, "full", tiny_dir, [base, base + extra],
                     {"tiers": {"dram_bytes": 0, "disk_dir": str(tmp_path / "kv")}}, fsize_limit=4096)
    assert "the disk is full" in err
    assert out["cached"] == [0, 640] and out["stats"]["disk"]["stored"] == 0
    assert_matches_cold(out["ids"][1], out["logits"][1], cold)
    assert not list((tmp_path / "kv").rglob("*.kv")) and not list((tmp_path / "kv").rglob("*.tmp"))


def test_engines_that_compute_other_kv_never_share_lower_tier_entries(fixtures):
    """An indexer ablation or a memory policy that hides entries from attention changes the KV an
    engine computes: its records carry another identity (a foreign record is never loaded). At the
    defaults the identity is the layout's alone, so the entries written before stay readable."""
    from hybridkv.cache.tiers.convert import layout_identity

    d = fixtures / "v4-tiny"
    engines = [make(d, **kw).engine for kw in ({}, {"indexer": "random"}, {"indexer": "random", "indexer_seed": 1},
                                               {"memory_policy": "recency-1024"})]
    ids = [e.tiers.identity for e in engines]
    assert len(set(ids)) == 4
    assert ids[0] == layout_identity(engines[0].store, engines[0].model_identity)
