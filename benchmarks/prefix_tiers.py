"""TTFT of a long prompt, cold vs a prefix hit from each tier, and the bytes per token each tier
stores under each window policy.

For each policy: engine A (tiers: DRAM, disk, and Redis when a redis-server is available) serves
the prompt cold and stores it (write-through); then the prompt plus a new 64-token message (the
next turn of an agent) is served as
- a device hit (A again),
- a DRAM hit (A with its device cache cleared),
- a disk hit (engine B: no DRAM tier; the entry files are dropped from the OS page cache first),
- a Redis hit (engine C: Redis only).
A hit at H recomputes the tokens after H (and, under `zero`, replays the 128 before H). TTFT is
the engine's own (request arrival to first token), median of --repeats. "no cache" is a cold run
with prefix caching off (on CUDA after an untimed run of the same prompt, which compiles the kernels
for every chunk shape; each tier's hits after one untimed hit). Bytes/token = bytes each tier stored for the prompt / prompt tokens.

    python benchmarks/prefix_tiers.py [--model DIR] [--tokens 16k] [--policies full,checkpoint(4096),zero]
        [--device cpu] [--kv-format native] [--dtype float32] [--redis-url URL | --no-redis] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.engine import LLM, SamplingParams  # noqa: E402


def say(msg: str) -> None:
    """Each measurement as it lands (stderr): a run stopped by a time limit still reports what it had."""
    print(msg, file=sys.stderr, flush=True)


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    if out.error:
        raise RuntimeError(out.error)
    return out.ttft, out.cached_tokens


def drop_page_cache(path: Path) -> None:
    """Evict the tier's files from the OS page cache (clean pages; no root needed)."""
    for f in path.rglob("*.kv"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start_redis(workdir: str):
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", workdir, "--maxmemory", "8gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.RedisError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def bench_policy(a, policy: str, prompt: list[int], turn: list[int], disk_dir: Path, redis_url: str | None) -> dict:
    common = dict(device=a.device, dtype=getattr(torch, a.dtype), num_blocks=len(turn) // 128 + 8, max_num_seqs=2,
                  window_policy=policy, max_model_len=len(turn) + 64, kv_format=a.kv_format, snapshot_bytes=8 << 30)
    tiers = {"dram_bytes": 16 << 30, "disk_dir": str(disk_dir), "max_pending_bytes": 16 << 30}
    if redis_url:
        tiers.update(redis_url=redis_url, redis_prefix=f"bench-{policy}")
    eng_a = LLM(a.model, tiers=tiers, **common)
    row = {"policy": policy}
    row["cold"], _ = ttft(eng_a, prompt)
    say(f"{policy}: cold TTFT {row['cold']:.3f} s ({len(prompt)} tokens)")
    t = time.perf_counter()
    eng_a.engine.tiers.flush()
    row["flush_s"] = time.perf_counter() - t
    say(f"{policy}: tiers flushed in {row['flush_s']:.3f} s")
    stats = eng_a.engine.cache_stats()
    row["bytes_per_token"] = {name: stats[name]["stored_bytes"] / len(prompt)
                              for name in ("dram", "disk", "redis") if name in stats}
    row["device_kv_bytes_per_token"] = eng_a.engine.store.bytes_per_token()

    def repeat(llm, before):
        times, cached = [], set()
        if a.device.startswith("cuda"):   # an untimed hit first: a hit's shapes (zero: the replay) compile
            before()
            ttft(llm, turn)
        for _ in range(a.repeats):
            before()
            t, c = ttft(llm, turn)
            times.append(t)
            cached.add(c)
            say(f"{policy}: hit TTFT {t:.3f} s, {c} cached tokens")
        return statistics.median(times), sorted(cached)

    row["device"], row["device_cached"] = repeat(eng_a, lambda: None)
    row["dram"], row["dram_cached"] = repeat(eng_a, eng_a.engine.prefix.clear_device)
    eng_b = LLM(a.model, tiers={"dram_bytes": 0, "disk_dir": str(disk_dir)}, **common)
    row["disk"], row["disk_cached"] = repeat(eng_b, lambda: (eng_b.engine.prefix.clear_device(),
                                                             drop_page_cache(disk_dir)))
    if redis_url:
        eng_c = LLM(a.model, tiers={"dram_bytes": 0, "redis_url": redis_url, "redis_prefix": f"bench-{policy}"},
                    **common)
        row["redis"], row["redis_cached"] = repeat(eng_c, eng_c.engine.prefix.clear_device)
        eng_c.close()
    for llm in (eng_a, eng_b):
        llm.close()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--tokens", type=_parse_count, default=16384)
    ap.add_argument("--policies", default="full,checkpoint(4096),zero")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-format", default="native", choices=["native", "bf16", "fp8", "v41"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's compute dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--redis-url", default=None, help="use this server (default: start a local redis-server)")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefix-tiers-"))
    proc, redis_url = (None, a.redis_url) if a.redis_url or a.no_redis else start_redis(str(work))
    try:
        probe = LLM(a.model, device=a.device, dtype=getattr(torch, a.dtype), num_blocks=8, max_num_seqs=1)
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(2, probe.config.vocab_size, (a.tokens + 64,), generator=g).tolist()
        prompt, turn = prompt[:a.tokens], prompt
        del probe
        nocache = LLM(a.model, device=a.device, dtype=getattr(torch, a.dtype), num_blocks=len(turn) // 128 + 8,
                      max_num_seqs=1, max_model_len=len(turn) + 64, kv_format=a.kv_format, enable_prefix_caching=False)
        if a.device.startswith("cuda"):   # compile the kernels for every chunk shape before anything is timed
            ttft(nocache, turn)
        cold_nocache, _ = ttft(nocache, turn)
        say(f"no prefix cache: TTFT {cold_nocache:.3f} s ({len(turn)} tokens)")
        del nocache
        rows = []
        for policy in a.policies.split(","):
            rows.append(bench_policy(a, policy, prompt, turn, work / policy.replace("(", "").replace(")", ""), redis_url))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    tiers = ["device", "dram", "disk"] + (["redis"] if redis_url else [])
    print(f"# prefix tiers: {a.tokens} tokens, model {Path(a.model).name}, kv format {a.kv_format}, {a.dtype}, "
          f"device {a.device}, {date.today()}, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    base = min([cold_nocache] + [r["cold"] for r in rows])
    print(f"# no prefix cache: TTFT of prompt + turn ({len(turn)} tokens) {cold_nocache:.3f} s; × = speed-up against "
          f"the fastest cold TTFT of this run ({base:.3f} s)")
    print("\n| policy | cold s (stores) | " + " | ".join(f"{t} hit s (×)" for t in tiers) + " | cached tokens |")
    print("|---|---|" + "---|" * len(tiers) + "---|")
    for r in rows:
        cells = [f"{r[t]:.3f} ({base / r[t]:.0f}×)" for t in tiers]
        print(f"| {r['policy']} | {r['cold']:.3f} | " + " | ".join(cells) + f" | {r['device_cached'][0]} |")
    names = [n for n in ("dram", "disk", "redis") if n in rows[0]["bytes_per_token"]]
    full = next((r for r in rows if r["policy"] == "full"), None)
    print("\n| policy | device compressed KV B/token | " + " | ".join(f"{n} B/token" for n in names)
          + " | disk vs full | disk vs compressed KV |")
    print("|---|---|" + "---|" * len(names) + "---|---|")
    for r in rows:
        disk = r["bytes_per_token"]["disk"]
        ratio = disk / full["bytes_per_token"]["disk"] if full else float("nan")
        compressed = r["device_kv_bytes_per_token"]
        vs_compressed = f"{disk / compressed:.3f}" if compressed else "– (no compressing layer)"
        print(f"| {r['policy']} | {compressed:.1f} | "
              + " | ".join(f"{r['bytes_per_token'][n]:.1f}" for n in names)
              + f" | {ratio:.3f} | {vs_compressed} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"tokens": a.tokens, "no_cache_ttft": cold_nocache, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
