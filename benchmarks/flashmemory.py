"""FlashMemory's serving cost against `full` on a V4-Flash-shaped stack: how many requests of a long
context a fixed device KV budget holds, their decode throughput, and the recall traffic over PCIe
with the share of it that the decode steps hide.

For each policy (`full`; `flashmemory-B`, B = --share, FlashMemory's ≈ 10 %) in a process of its
own, and each context (--contexts, default 128k,512k,1m):

1. The KV store is sized to --kv-budget of device memory from its own bytes per block, per device
   page and per request slot: under `full` every entry is on the device; under `flashmemory` the CSA
   main entries of every block live in (pinned) host memory and the device holds the other entries
   (indexer keys, HCA, window rings, compressor state) plus pages for the resident CSA blocks, B of
   a request's complete blocks and four more (the block being filled, one opened since the last
   recall, two while a recall's copies are in flight). The requests held is what that budget holds
   at the context; the row is measured with that many running, and fails if the allocator preempts
   one.
2. One request is prefilled to the context and forked (EngineCore.fork, copies of its cache) into
   the others: the pool is filled without prefilling every request.
3. --steps decode steps of all of them back to back (≥ 2 recall windows of 64 steps: the memory
   indexer scores every chunk of every request, the policy picks B of the blocks, their pages are
   copied on the copy stream while decoding goes on). The memory indexer is untrained
   (`MemoryIndexer.random`): it costs what a trained one costs, and recalls B of the blocks, about
   90 % of them new at every recall (a trained one keeps many: this is the traffic's upper end).
   The window starts after a warm-up through the first decode recall (decode graphs captured, the
   recall's kernels compiled for these shapes; that step's host time is reported apart). Reported: decode tokens/s, median and recall-step ms, the steps replayed from decode graphs
   (batches up to 64 requests; `HYBRIDKV_GRAPH_BATCH` raises it), device KV per request (the allocator's),
   pages recalled and their bytes, the recall rate over the window, and on CUDA from a profiled
   second window: the recall copies' device time (the row gathers that read the pinned host pool)
   and the share of it during which decode kernels ran (hidden).

    python benchmarks/flashmemory.py --ckpt /tmp/v4flash-8 [--contexts 128k,512k,1m] [--kv-budget 2g]
        [--share 0.1] [--steps 192] [--policies full,flashmemory] [--chunk 16384] [--json OUT]
    python benchmarks/flashmemory.py --smoke      # a tiny model on the CPU: checks the script runs

The checkpoint is written once (`hybridkv.tools.random_checkpoint`, V4-Flash's real widths) if
missing. CPU numbers (--smoke) are not results.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.memory.policies import complete_blocks_kept  # noqa: E402
from decode_context import sync  # noqa: E402  (this folder is on sys.path)
from engine_gpu import collect_rows, emit, ensure_checkpoint, fmt, fmt_bytes  # noqa: E402

INTERVAL = 64          # the memory policies' recall cadence (decode steps)
WARM_STEPS = 4
TOP_KERNELS = 10
RECALL_KERNEL = "gather_rows"   # the row gather that reads recalled pages from the pinned host pool


def store_costs(config) -> dict[str, int]:
    """Device bytes of one block (every layer's entries), of its CSA main entries, of one device page
    and of one request slot (window rings and compressor state), from a one-block store."""
    from hybridkv.cache.paged import PagedKVStore
    probe = PagedKVStore(config, 1, 1, "fp8", torch.bfloat16, "cpu", resident_pages=1)
    per_block = probe.block_bytes()
    return dict(block=sum(per_block.values()), csa_main=per_block["CSA main"], page=probe.page_bytes(),
                slot=sum(probe.slot_bytes().values()))


def sizing(costs: dict[str, int], policy: str, share: float, context: int, tokens: int, budget: int) -> dict:
    """Blocks a request needs for its context and decoded tokens, the pages it keeps resident, its
    device bytes, and how many such requests `budget` bytes hold (the store's pools sized for them)."""
    blocks = -(-(context + tokens) // 128)
    if policy == "full":
        pages, per_request = 0, blocks * costs["block"] + costs["slot"]
    else:
        # the policy's blocks, the one being filled, one opened since the last recall, and two for a
        # recall whose copies are in flight while a block opens (else a request would be preempted)
        pages = complete_blocks_kept(share, blocks - 1) + 4
        per_request = blocks * (costs["block"] - costs["csa_main"]) + pages * costs["page"] + costs["slot"]
    n = budget // per_request
    return dict(blocks=blocks, pages=pages, per_request=per_request, requests=n,
                num_blocks=n * blocks, resident_pages=n * pages if pages else None)


def copy_overlap(trace_path: str) -> dict[str, float]:
    """From a profiler trace: ms of the recall's copies (host-to-device copies and the row gathers that
    read the pinned host pool), ms of them during which another kernel ran, ms of those other
    kernels, the copies' count, and the kernels of the window with the most device time
    ([name, ms, launches])."""
    events = [e for e in json.loads(Path(trace_path).read_text()).get("traceEvents", []) if "dur" in e]
    gathers = [e for e in events if e.get("cat") == "kernel" and RECALL_KERNEL in e.get("name", "")]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "kernel" and RECALL_KERNEL not in e.get("name", ""))
    copies = sorted([(e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")] +
                    [(e["ts"], e["ts"] + e["dur"]) for e in gathers])
    merged: list[list[float]] = []
    for a, b in kernels:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    hidden, i = 0.0, 0
    for a, b in copies:
        while i < len(merged) and merged[i][1] <= a:
            i += 1
        j = i
        while j < len(merged) and merged[j][0] < b:
            hidden += min(b, merged[j][1]) - max(a, merged[j][0])
            j += 1
    by_name: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "kernel":
            t = by_name.setdefault(e.get("name", "?")[:60], [0.0, 0])
            t[0], t[1] = t[0] + e["dur"] / 1e3, t[1] + 1
    top = sorted(([name, round(ms, 3), n] for name, (ms, n) in by_name.items()), key=lambda x: -x[1])[:TOP_KERNELS]
    return dict(copy_ms=sum(b - a for a, b in copies) / 1e3, hidden_ms=hidden / 1e3,
                kernel_ms=sum(b - a for a, b in merged) / 1e3, copies=len(copies), top_kernels=top)


def worker(a) -> None:
    from hybridkv.engine import EngineConfig, SamplingParams
    from hybridkv.engine.core import EngineCore
    from hybridkv.engine.tokenizer import Tokenizer
    from hybridkv.memory.indexer import MemoryIndexer
    from hybridkv.weights import checkpoint_identity, load_model
    cuda = a.device.startswith("cuda")
    model, config = load_model(a.ckpt, device=a.device, dtype=torch.bfloat16 if cuda else torch.float32)
    tokenizer, identity = Tokenizer.from_model_dir(Path(a.ckpt)), checkpoint_identity(a.ckpt)
    costs = store_costs(config)
    policy = "full" if a.worker == "full" else f"flashmemory-{a.share:g}"
    tmp = Path(tempfile.mkdtemp(prefix="hybridkv-fm-"))
    indexer = MemoryIndexer.random(config).save(tmp) if policy != "full" else None
    steps = INTERVAL + 2 + 2 * a.steps + 4        # each request's decoded tokens: the warm-up and both windows
    for context in [_parse_count(c) for c in a.contexts.split(",") if c]:
        context = min(context, config.max_position_embeddings - steps - 2)
        size = sizing(costs, policy, a.share, context, steps + 1, a.kv_budget)
        if size["requests"] < 1:
            emit(dict(kind="row", policy=policy, context=context, requests=0, per_request=size["per_request"],
                      why=f"one request takes {size['per_request']:,} device bytes: more than --kv-budget"))
            continue
        if cuda:
            torch.cuda.empty_cache()
        eng = EngineCore(model, tokenizer, identity, EngineConfig(
            kv_format="fp8", num_blocks=size["num_blocks"], resident_pages=size["resident_pages"],
            max_num_seqs=size["requests"], max_num_batched_tokens=a.chunk, enable_prefix_caching=False,
            memory_policy=policy, memory_indexer=str(indexer) if indexer else None))
        device_pool, host_pool = sum(eng.store.nbytes_by_kind().values()), eng.store.host_bytes()
        ids = torch.randint(2, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
        t = time.perf_counter()
        src = eng.add_request(ids, SamplingParams(max_tokens=steps, ignore_eos=True))
        while not src.output_ids:
            eng.step()
        sync(a.device)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()
        seqs = [src] + (eng.fork(src.request_id, size["requests"] - 1) if size["requests"] > 1 else [])
        sync(a.device)
        fork_s = time.perf_counter() - t
        # decode graphs for the batch captured, and the first decode recall run (its kernels compiled
        # for these shapes: a one-off, reported apart)
        first_recall = None
        while len(src.output_ids) < max(WARM_STEPS, INTERVAL + 2):
            recall = (len(src.output_ids) + 1) % INTERVAL == 1
            t = time.perf_counter()
            eng.step()
            if recall:
                first_recall = time.perf_counter() - t
        stats, preempted = eng.stats, eng.scheduler.num_preemptions
        loaded, evicted, graphed = stats.pages_loaded, stats.pages_evicted, stats.graph_steps
        # host time of each step call, no wait for the device between them (as in serving: with async
        # scheduling a call returns once the next step is queued, so in steady state it lasts a step)
        times, recall_steps = [], []
        sync(a.device)
        start = time.perf_counter()
        hot = cProfile.Profile() if a.cprofile else None
        for _ in range(a.steps):
            recall = (len(src.output_ids) + 1) % INTERVAL == 1    # this step's token runs the policy
            if recall and hot:
                hot.enable()
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
            if recall:
                recall_steps.append(times[-1])
                if hot:
                    hot.disable()
        sync(a.device)
        window = time.perf_counter() - start
        if hot:
            print(f"# {policy} at {context:,}: host time of the {len(recall_steps)} recall steps, under cProfile")
            pstats.Stats(hot).sort_stats("tottime").print_stats(a.cprofile)
            pstats.Stats(hot).sort_stats("cumulative").print_stats(a.cprofile)
        loaded, evicted = stats.pages_loaded - loaded, stats.pages_evicted - evicted
        graphed = stats.graph_steps - graphed
        overlap = None
        if cuda and policy != "full":               # a second window under the profiler: where the copies ran
            from torch.profiler import ProfilerActivity, profile
            trace = str(tmp / f"trace-{context}.json")
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    eng.step()
                sync(a.device)
            prof.export_chrome_trace(trace)
            overlap = copy_overlap(trace)
            os.remove(trace)
        ended = sum(s.finish_reason is not None for s in seqs)
        if ended or eng.scheduler.num_preemptions != preempted:
            raise RuntimeError(f"{policy} at {context:,}: {ended} requests ended and "
                               f"{eng.scheduler.num_preemptions - preempted} were preempted during the measurement")
        per_request = eng.store.device_bytes(src.cache)
        emit(dict(kind="row", policy=policy, context=context, requests=len(seqs), prefill_s=prefill_s, fork_s=fork_s,
                  device_pool=device_pool, host_pool=host_pool, per_request=sum(per_request.values()),
                  per_request_by_kind=per_request, planned_per_request=size["per_request"],
                  tok_s=len(seqs) * a.steps / window, step_ms=1e3 * statistics.median(times),
                  recall_step_ms=1e3 * statistics.mean(recall_steps) if recall_steps else None,
                  first_recall_ms=1e3 * first_recall if first_recall is not None else None,
                  recalls=len(recall_steps), graph_steps=graphed, pages_loaded=loaded, pages_evicted=evicted,
                  page_bytes=costs["page"],
                  recall_bytes=loaded * costs["page"], recall_gbps=loaded * costs["page"] / window / 1e9,
                  window_s=window, overlap=overlap))
        for s in seqs:
            eng.abort(s.request_id)
        eng.close()
        del eng, src, seqs


def report(rows: list[dict], a) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: not a result)"
    print(f"\n# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {dev}, torch {torch.__version__}; "
          f"command: python benchmarks/flashmemory.py {' '.join(sys.argv[1:])}; KV budget {fmt_bytes(a.kv_budget)}")
    print("\n| policy | context | requests held | device KV / request | decode tok/s | step ms | recall step ms | "
          "graph steps | pages recalled | recall GB/s | copies ms (hidden) | prefill s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    full = {r["context"]: r for r in rows if r["policy"] == "full" and r.get("requests")}
    for r in rows:
        if not r.get("requests"):
            print(f"| {r['policy']} | {r['context']:,} | 0 | {fmt_bytes(r['per_request'])} | {r['why']} ||||||||")
            continue
        ov = r.get("overlap")
        copies = f"{ov['copy_ms']:.1f} ({ov['hidden_ms'] / ov['copy_ms']:.0%})" if ov and ov["copy_ms"] else "—"
        print(f"| {r['policy']} | {r['context']:,} | {r['requests']} | {fmt_bytes(r['per_request'])} | "
              f"{r['tok_s']:.0f} | {r['step_ms']:.2f} | {fmt(r['recall_step_ms'])} ({fmt(r.get('first_recall_ms'))}) | {r['graph_steps']}/{a.steps} | "
              f"{r['pages_loaded']:,} | "
              f"{r['recall_gbps']:.2f} | {copies} | {r['prefill_s']:.1f} |")
    print()
    for r in rows:
        base = full.get(r["context"])
        if r["policy"] != "full" and r.get("requests") and base:
            print(f"- {r['context']:,}: {r['policy']} holds {r['requests'] / base['requests']:.2f}x the requests "
                  f"of full ({r['requests']} vs {base['requests']}) at {r['tok_s'] / base['tok_s']:.2f}x its decode "
                  f"tokens/s; device KV per request {r['per_request'] / base['per_request']:.1%} of full's")
    for r in rows:
        ov = r.get("overlap")
        if ov and ov.get("top_kernels"):
            print(f"- {r['policy']} at {r['context']:,}, the profiled window's kernels by device ms: " +
                  ", ".join(f"{name} {ms:.1f} ({n})" for name, ms, n in ov["top_kernels"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (written there if missing)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--contexts", default="128k,512k,1m")
    ap.add_argument("--kv-budget", type=_parse_count, default=_parse_count("2g"),
                    help="device bytes for the KV store (blocks, pages, request slots), e.g. 8g, 512m")
    ap.add_argument("--share", type=float, default=0.1, help="flashmemory's resident share of the blocks")
    ap.add_argument("--policies", default="full,flashmemory")
    ap.add_argument("--steps", type=int, default=2 * INTERVAL + 64, help="decode steps a window (≥ 2 recalls)")
    ap.add_argument("--chunk", type=int, default=16384, help="prefill tokens per engine step")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, to check the script")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="print the N costliest functions of the recall steps' host time (cProfile; slows them)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        a.device, a.layers, a.chunk, a.steps = "cpu", 3, 1024, INTERVAL + 8
        a.contexts = "2k,4k" if a.contexts == ap.get_default("contexts") else a.contexts
        a.kv_budget = _parse_count("24m") if a.kv_budget == ap.get_default("kv_budget") else a.kv_budget
        a.ckpt = a.ckpt or str(Path(tempfile.gettempdir()) / "hybridkv-flashmemory-smoke")
    if a.ckpt is None:
        ap.error("--ckpt DIR is required (the checkpoint is written there once and reused)")
    if a.worker:
        worker(a)
        return 0
    ensure_checkpoint(a)
    rows: list[dict] = []
    for policy in a.policies.split(","):
        if policy not in ("full", "flashmemory"):
            ap.error(f"--policies: unknown policy {policy!r} (full, flashmemory)")
        cmd = [sys.executable, __file__, "--worker", policy] + sys.argv[1:]
        code = collect_rows(cmd, dict(os.environ), rows, a.json)
        if code:
            print(f"# {policy} failed (exit {code}); its rows so far are kept", flush=True)
    report(rows, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
