"""Load test of `hybridkv serve` over loopback: N concurrent streaming chat clients.

Starts the server in this process (uvicorn on 127.0.0.1, a free port) on a model directory, then
runs N clients; each sends R streaming chat requests one after another (a shared system prompt,
so later requests hit the prefix cache, plus a per-client question). The run is bounded by the
request count and by --deadline seconds. Reports p50/p99 time to first token, inter-token
latency, throughput, errors, the prefix hit rate, and checks that the KV allocator is back to
idle (no block held, every slot free, pool bookkeeping consistent) after the clients finish.

    python benchmarks/server_load.py [--model DIR] [--tokenizer FILE] [--clients 8] [--requests 4]
                                     [--max-tokens 32] [--out DIR]

Soak mode (`--soak-minutes N`): for N minutes the clients send distinct long prompts (random
token ids, --soak-tokens MIN-MAX long, 2 tokens out, nothing shared, so every prompt is new to
the prefix cache and fills the DRAM tier and the snapshots), and the server's resident memory
(VmRSS, from /stats) is sampled every --soak-sample-s seconds into a table, with the DRAM tier's
and the window snapshots' use (bounded pools that fill up to their budgets) and what remains
beside them, which should stay flat; the last sample is taken after the engine went idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import sys
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

from hybridkv.cache.tiers.config import TierConfig, parse_size  # noqa: E402
from hybridkv.server.limits import uvicorn_config  # noqa: E402
from hybridkv.server.serve import build_server  # noqa: E402

SYSTEM = ("You are a careful assistant. " + "Answer with short, precise sentences and cite the facts you use. " * 12)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, cid: int, rid: int, max_tokens: int) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True,
            "messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"Client {cid}, question {rid}: what is {cid} plus {rid}?"}]}
    t0 = time.perf_counter()
    stamps, usage, error = [], None, None
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"]["message"]
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices", []):
                    d = ch.get("delta", {})
                    if d.get("content") or d.get("reasoning_content"):
                        stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if error or usage is None:
        return {"error": error or "no usage in the stream"}
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"ttft": stamps[0] - t0 if stamps else None, "itl": gaps,
            "tokens": usage["completion_tokens"], "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"], "latency": time.perf_counter() - t0}


async def run_clients(url: str, model: str, clients: int, requests: int, max_tokens: int, deadline: float) -> list:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        async def worker(cid: int) -> list:
            out = []
            for rid in range(requests):
                if time.perf_counter() > deadline:
                    out.append({"error": "deadline reached before the request was sent"})
                    continue
                out.append(await one_request(client, url, model, cid, rid, max_tokens))
            return out
        per_client = await asyncio.gather(*(worker(c) for c in range(clients)))
    return [r for rs in per_client for r in rs]


async def soak(url: str, model: str, clients: int, minutes: float, tokens: tuple[int, int], vocab: int,
               sample_s: float) -> tuple[list[dict], int, list[str]]:
    """Distinct long prompts for `minutes`; returns the memory samples, requests done, errors."""
    end = time.perf_counter() + 60 * minutes
    done, errors, samples = [0], [], []
    t0 = time.perf_counter()

    async def sample(client: httpx.AsyncClient) -> None:
        s = (await client.get(url + "/stats")).json()
        host = s["memory"]["host"]
        samples.append({"t_s": time.perf_counter() - t0, "requests": done[0], "resident": host["resident"],
                        "dram": host["pools"]["dram tier"]["used"],
                        "snapshots": host["pools"]["window snapshots"]["used"],
                        "blocks_active": s["memory"]["blocks"]["active"]})

    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
        async def worker(cid: int) -> None:
            rng = random.Random(cid)
            while time.perf_counter() < end:
                ids = [rng.randrange(4, vocab) for _ in range(rng.randint(*tokens))]
                r = await client.post(url + "/v1/completions", json={"model": model, "prompt": ids, "max_tokens": 2})
                if r.status_code != 200:
                    errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                done[0] += 1

        async def sampler() -> None:
            while time.perf_counter() < end:
                await sample(client)
                await asyncio.sleep(sample_s)

        await asyncio.gather(sampler(), *(worker(c) for c in range(clients)))
        await asyncio.sleep(3.0)        # idle: the engine gives freed memory back
        await sample(client)
    return samples, done[0], errors


def _finish(a, errors: list, filename: str, payload: dict) -> None:
    """The first errors on stdout, and the run's JSON under --out."""
    if errors:
        print("errors:", *errors[:5], sep="\n  ")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / filename).write_text(json.dumps(payload, indent=2))


def soak_report(a, server, url: str) -> int:
    lo, hi = (int(x) for x in a.soak_tokens.split("-"))
    hi = min(hi, server.engine.max_model_len - 8)
    samples, n, errors = asyncio.run(soak(url, server.config.model_name, a.clients, a.soak_minutes, (lo, hi),
                                          server.engine.config.vocab_size, a.soak_sample_s))
    mib = 1 << 20
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}"
    print(f"hybridkv server soak · {machine} · torch {torch.__version__} ({torch.get_num_threads()} threads) · "
          f"{date.today()}\n{' '.join([os.path.basename(sys.executable), *sys.argv])}\n")
    print(f"{n} distinct prompts of {lo}-{hi} tokens in {a.soak_minutes:g} min, {a.clients} client(s), "
          f"{len(errors)} errors\n")
    print("| time | requests | resident | DRAM tier | window snapshots | resident - both | KV blocks held |")
    print("|---|---|---|---|---|---|---|")
    for i, s in enumerate(samples):
        label = "idle after" if i == len(samples) - 1 else f"{s['t_s']:.0f} s"
        print(f"| {label} | {s['requests']} | {s['resident'] / mib:.0f} MiB | {s['dram'] / mib:.0f} MiB | "
              f"{s['snapshots'] / mib:.0f} MiB | {(s['resident'] - s['dram'] - s['snapshots']) / mib:.0f} MiB | "
              f"{s['blocks_active']} |")
    _finish(a, errors, "server_soak.json", {"date": str(date.today()), "machine": machine,
                                           "minutes": a.soak_minutes, "tokens": [lo, hi], "requests": n,
                                           "errors": len(errors), "samples": samples})
    return 0 if not errors else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "tests/fixtures/v4-tiny"))
    ap.add_argument("--tokenizer", default=None, help="default: MODEL/tokenizer.json, else the tiny test tokenizer")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", "--max-concurrency", dest="max_num_seqs", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=128)
    ap.add_argument("--deadline", type=float, default=600.0, help="seconds; no request is sent after it")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--soak-minutes", type=float, default=None, help="soak mode: distinct long prompts for N minutes")
    ap.add_argument("--soak-tokens", default="2000-6000", help="soak prompt length range in tokens (MIN-MAX)")
    ap.add_argument("--soak-sample-s", type=float, default=15.0, help="soak: seconds between memory samples")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--kv-dram-size", default=None, help="the host-DRAM prefix tier's size (default: the engine's)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    tok = a.tokenizer
    if tok is None and not (Path(a.model) / "tokenizer.json").exists():
        tok = str(ROOT / "tests/fixtures/tokenizer-tiny/tokenizer.json")
    extra = {"tiers": TierConfig(dram_bytes=parse_size(a.kv_dram_size))} if a.kv_dram_size else {}
    server = build_server(a.model, tokenizer_path=tok, device=a.device, max_num_seqs=a.max_num_seqs,
                          num_blocks=a.num_blocks, max_queued=4 * a.clients, **extra)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    uv = uvicorn.Server(uvicorn_config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)

    if a.soak_minutes:
        try:
            return soak_report(a, server, url)
        finally:
            uv.should_exit = True
            thread.join(10)

    # one warm-up request (first-call compilation), not measured
    asyncio.run(run_clients(url, server.config.model_name, 1, 1, 4, time.perf_counter() + 120))
    t0 = time.perf_counter()
    results = asyncio.run(run_clients(url, server.config.model_name, a.clients, a.requests, a.max_tokens,
                                      t0 + a.deadline))
    wall = time.perf_counter() - t0

    idle_deadline = time.time() + 10
    while True:
        stats = httpx.get(url + "/stats").json()
        mem = stats["memory"]
        idle = (mem["blocks"]["active"] == 0 and mem["slots"]["free"] == mem["slots"]["total"]
                and mem["requests"]["running"] == 0 and mem["requests"]["waiting"] == 0 and stats["inflight"] == 0)
        if idle or time.time() > idle_deadline:
            break
        time.sleep(0.05)
    server.engine.store.pool.check()
    uv.should_exit = True
    thread.join(10)

    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    prompt = sum(r["prompt"] for r in ok)
    cached = sum(r["cached"] for r in ok)
    report = {
        "date": str(date.today()), "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "model": a.model,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "clients": a.clients, "requests": len(results), "completed": len(ok), "errors": len(errors),
        "max_tokens": a.max_tokens, "wall_s": wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50), "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50), "itl_p99_ms": 1000 * pct(itl, 99),
        "output_tok_s": tokens / wall, "requests_s": len(ok) / wall,
        "mean_latency_s": statistics.fmean(r["latency"] for r in ok) if ok else float("nan"),
        "prompt_tokens": prompt, "cached_prompt_tokens": cached, "prefix_hit_rate": cached / prompt if prompt else 0,
        "allocator_idle_after": idle, "blocks_held_after": mem["blocks"]["active"],
        "error_samples": errors[:5],
    }
    print(f"hybridkv server load · {report['machine']} · torch {report['torch']} ({report['threads']} threads) · "
          f"{report['date']}\n{report['command']}\n")
    print("| clients | requests | errors | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s | req/s | "
          "prefix hits | allocator idle after |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {a.clients} | {len(results)} | {len(errors)} | {report['ttft_p50_ms']:.0f} ms | "
          f"{report['ttft_p99_ms']:.0f} ms | {report['itl_p50_ms']:.1f} ms | {report['itl_p99_ms']:.1f} ms | "
          f"{report['output_tok_s']:.1f} | {report['requests_s']:.2f} | {100 * report['prefix_hit_rate']:.1f}% | "
          f"{'yes' if idle else 'NO'} ({mem['blocks']['active']} blocks held) |")
    _finish(a, errors, f"server_load_c{a.clients}.json", report)
    return 0 if not errors and idle else 1


if __name__ == "__main__":
    sys.exit(main())
