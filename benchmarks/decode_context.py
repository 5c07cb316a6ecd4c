"""Decode speed against context length, through the engine: one request (or a batch) prefilled to
each context, then timed decode steps. Prints a row per context as it lands:

    context, prefill s, decode ms/step, tokens/s, drop against the shortest context, device ms
    per step (CUDA: the step's graph replayed back to back between device events), device busy per
    step (CUDA, under torch.profiler), the device bytes the requests hold once prefilled (blocks,
    window rings, compressor states: the allocator's own count) and the top operators by device time.

The headline is free of the host's jitter: the timed steps run in `--passes` passes (each pass's
median step), and a row gives the median of those with their spread; the device time beside it
does not depend on the host at all.

On CUDA the engine replays captured decode steps (engine/graphs.py); with --eager the same requests
are also decoded with the paged kernels launched one by one, and with --reference through the
reference path (rows gathered and decoded from the store before attention; what the engine does
where the paged kernels do not apply), on the same cache.

    python benchmarks/decode_context.py --model DIR [--contexts 4k,128k,1m] [--batch 1] [--steps 64]
        [--device cuda] [--kv-format fp8] [--dtype bfloat16] [--chunk 8192] [--eager] [--reference] [--top 12]
        [--host-profile N] [--passes 3] [--json OUT]

A context of "1m" is clamped to the checkpoint's max_position_embeddings minus the decoded tokens.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.engine import LLM, SamplingParams  # noqa: E402

WARM_STEPS = 4


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_steps(engine, steps: int, device: str) -> list[float]:
    out = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        sync(device)
        out.append(time.perf_counter() - t)
    return out


def passes_ms(engine, passes: int, steps: int, device: str) -> tuple[float, float, float]:
    """(median, lowest, highest) over `passes` passes of each pass's median step time, in ms."""
    medians = [1e3 * statistics.median(timed_steps(engine, steps, device)) for _ in range(passes)]
    return statistics.median(medians), min(medians), max(medians)


def replay_ms(eng, n: int = 20, batch: int | None = None) -> float | None:
    """Elapsed device time of the most recently replayed decode graph (the last step's; with
    speculation the speculative step's; with `batch`, the latest of that batch size's) replayed n
    times back to back (it rewrites the same step's cache rows with the same values), per replay."""
    from hybridkv.engine.graphs import padded_batch
    holder = getattr(eng, "spec_graphs", None) or eng.graphs
    captured = [g.graph for key, g in holder.graphs.items()
                if g.graph is not None and (batch is None or key[0] == padded_batch(batch))] if holder else []
    if not captured:
        return None
    graph = captured[-1]
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def profiled_steps(engine, steps: int, device: str, top: int) -> tuple[float, str]:
    """Device time per step and the top operators by device time (CUDA only)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, steps, device)
    events = prof.key_averages()
    # kernels (and copies) only: an operator's own device time repeats its kernels' time
    busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3 / steps
    return busy, events.table(sort_by="self_device_time_total", row_limit=top)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--contexts", default="4k,128k,1m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per pass and context")
    ap.add_argument("--passes", type=int, default=3, help="passes of --steps steps; the median pass counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-format", default="native", choices=["native", "bf16", "fp8", "v41"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per engine step")
    ap.add_argument("--eager", action="store_true", help="also time the paged kernels without CUDA graphs")
    ap.add_argument("--reference", action="store_true", help="also time the reference attention path")
    ap.add_argument("--top", type=int, default=12, help="operators listed per profile (CUDA)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="also print where the host's time goes (cProfile of N steps, by own time)")
    a = ap.parse_args()
    contexts = [_parse_count(c) for c in a.contexts.split(",")]
    if a.passes < 1 or a.steps < 1:
        ap.error("--passes and --steps must be at least 1")
    budget = WARM_STEPS + 3 * (a.passes * a.steps + 6 + a.host_profile) + 16
    llm = LLM(a.model, device=a.device, dtype=getattr(torch, a.dtype), kv_format=a.kv_format,
              num_blocks=a.batch * (max(contexts) // 128 + 4) + 8, max_num_seqs=a.batch,
              max_num_batched_tokens=a.chunk, enable_prefix_caching=False)
    eng = llm.engine
    limit = eng.max_model_len - budget
    contexts = [min(c, limit) for c in contexts]
    cuda = a.device.startswith("cuda")
    print(f"# {Path(a.model).name}: {eng.config.num_hidden_layers} layers, ratios {list(eng.config.compress_ratios)}, "
          f"kv {a.kv_format}, {a.dtype}, batch {a.batch}, device "
          f"{torch.cuda.get_device_name() if cuda else 'CPU'}, torch {torch.__version__}; "
          f"attention path: {'paged kernels ' + str(eng.store.kernel_formats) if eng.store.kernel_formats else 'reference'}",
          flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    base = None
    for ctx in contexts:
        seqs = [eng.add_request(torch.randint(2, eng.config.vocab_size, (ctx,), generator=g).tolist(),
                                SamplingParams(max_tokens=budget, ignore_eos=True)) for _ in range(a.batch)]
        t = time.perf_counter()
        while any(s.first_token_time is None for s in seqs):
            eng.step()
        sync(a.device)
        prefill_s = time.perf_counter() - t
        # the device bytes the requests hold at this context (blocks, window rings, compressor states)
        kv_mib = sum(sum(eng.store.device_bytes(s.cache).values()) for s in seqs) / 2**20
        timed_steps(eng, WARM_STEPS, a.device)
        graphs, formats = eng.graphs, eng.store.kernel_formats
        # (name, kernel formats, graphs): the same cache, read one way or the other
        paths = [("graphs" if graphs else "kernels" if formats else "reference", formats, graphs)]
        if a.eager and graphs:
            paths.append(("kernels", formats, None))
        if a.reference and formats:
            paths.append(("reference", None, None))
        for name, fmt, gr in paths:
            eng.store.kernel_formats, eng.graphs = fmt, gr
            before = eng.stats.graph_steps
            if gr is not None:
                timed_steps(eng, 2, a.device)           # captures this context's graph
            step_ms, low_ms, high_ms = passes_ms(eng, a.passes, a.steps, a.device)
            if gr is not None:
                assert eng.stats.graph_steps - before == a.passes * a.steps + 2, "a step ran outside the graph"
            row = dict(context=ctx, batch=a.batch, path=name, prefill_s=prefill_s, step_ms=step_ms,
                       pass_ms=[low_ms, high_ms], tok_s=1e3 * a.batch / step_ms, kv_mib=kv_mib)
            if gr is not None and cuda:
                row["replay_ms"] = replay_ms(eng)
            if name == paths[0][0]:
                base = base or row["tok_s"]
                row["drop_pct"] = 100 * (1 - row["tok_s"] / base)
            if cuda:
                row["device_ms_per_step"], table = profiled_steps(eng, 4, a.device, a.top)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if cuda:
                print(table, flush=True)
            if a.host_profile:
                prof = cProfile.Profile()
                prof.runcall(timed_steps, eng, a.host_profile, a.device)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top * 2)
                print(text.getvalue()[-6000:], flush=True)
        eng.store.kernel_formats, eng.graphs = formats, graphs
        for s in seqs:
            eng.abort(s.request_id)
    print(f"\n| context | path | prefill s | decode ms/step (median of {a.passes} passes) | passes' range | tok/s | "
          "drop vs shortest | device ms/step (replayed) | device busy ms/step | KV held, MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        drop = f"{r['drop_pct']:.1f}%" if "drop_pct" in r else "—"
        replay = f"{r['replay_ms']:.2f}" if r.get("replay_ms") is not None else "—"
        busy = f"{r['device_ms_per_step']:.2f}" if "device_ms_per_step" in r else "—"
        low, high = r["pass_ms"]
        print(f"| {r['context']:,} | {r['path']} | {r['prefill_s']:.1f} | {r['step_ms']:.2f} | {low:.2f}–{high:.2f} | "
              f"{r['tok_s']:.1f} | {drop} | {replay} | {busy} | {r['kv_mib']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
