"""The sharded engine on several GPUs of one host against one GPU, on the same V4-Flash-shaped stack.

The checkpoint and the decode cells are `engine_gpu.py`'s (a random V4-Flash stack at the real MoE
width in the release format, fp8 KV, CUDA-graph decode, async scheduling). Each layout runs in a
fresh process, rank 0 of its world (the others are the engine's worker processes):

- `1`: one GPU (the baseline);
- `epN`: N GPUs, attention heads, vocabulary and shared expert split, whole routed experts per
  rank (expert parallel, the default of `--tensor-parallel-size N`);
- `tpN`: the same with every routed expert's width split instead (`--expert-parallel-size 1`).

For each layout and decode cell (batch × context): wall ms per step (steps back to back), device
ms per step on rank 0 (its kernels under torch.profiler), of which NCCL's kernels (the
collectives, including each one's wait for the slowest rank), tokens/s, and the least bytes the
busiest rank must read in a step: its share of the non-expert weights, its share of the routed
experts the step selected (counted in an eager step with hooks on the gates; expert parallel: the
most any rank holds), and the whole KV the attention kernels read (V4's single KV head: every rank
holds and reads all of it). `ratio` = device ms ÷ (those bytes ÷ --bandwidth); `speedup` = the
one-GPU layout's device ms ÷ this layout's, `efficiency` = speedup ÷ N. Memory: each GPU's
`memory.used` (nvidia-smi) after loading and after the cells (the caching allocators keep their
peaks), and rank 0's peak of allocated bytes.

    python benchmarks/engine_multi_gpu.py --ckpt /tmp/v4flash-8 [--layers 8] [--layouts 1,ep2,tp2]
        [--batches 1,8,64] [--contexts 4k,128k] [--max-tokens 1.1m] [--steps 16] [--json OUT]
    python benchmarks/engine_multi_gpu.py --smoke    # a tiny model, two gloo ranks on the CPU

The experts a step selects are counted on one GPU (an eager step with hooks on the gates; the
ranks of a sharded engine cannot leave their graphs one at a time): the layouts of several GPUs
take the counts of layout `1` run before them in the same command, on the same prompts (without
it their bytes are not given).
NCCL's NVLink multicast is kept off (NCCL_NVLS_ENABLE=0) unless the environment sets it. CPU
numbers (--smoke) are not results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.weights import INDEX_FILE  # noqa: E402
from decode_context import timed_steps  # noqa: E402  (this folder is on sys.path)
from engine_gpu import (WARM_STEPS, ExpertCounter, collect_rows, decode_budget, device_ms, emit,  # noqa: E402
                        ensure_checkpoint, fmt, fmt_bytes, kv_read_bytes, pool_blocks, steps_back_to_back,
                        weight_bytes, workload)

COMMUNICATION = "communication (NCCL)"


def parse_layout(name: str) -> tuple[int, int | None]:
    """(world, expert_parallel_size) of a layout name: "1", "epN" or "tpN"."""
    if name == "1":
        return 1, None
    m = re.fullmatch(r"(ep|tp)(\d+)", name)
    if not m or int(m.group(2)) < 2:
        raise ValueError(f"layout {name!r}: use 1, epN or tpN with N ≥ 2")
    world = int(m.group(2))
    return world, world if m.group(1) == "ep" else 1


def gpu_memory_used() -> list[int] | None:
    """Bytes in use on each GPU (nvidia-smi's memory.used: every process's allocations and contexts)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [int(x) * 2**20 for x in out.split()]


def busiest_rank_experts(per_layer: list[set[int]], n_experts: int, world: int, expert_parallel: bool) -> int:
    """Routed experts the busiest rank reads in a step: expert parallel, the most selected experts
    any rank's contiguous share holds; otherwise (one rank, or every expert's width split) all."""
    if world == 1 or not expert_parallel:
        return sum(len(s) for s in per_layer)
    share = n_experts // world
    return max(sum(sum(1 for e in s if e // share == r) for s in per_layer) for r in range(world))


class HostTimers:
    """Host milliseconds a sharded leader spends in its two exchanges with the workers while
    attached: the command broadcast (each step's "step") and the schedule check before each
    forward. Nothing to time in one process."""

    def __init__(self, eng):
        self.eng, self.ms = eng, {}

    def _timed(self, name, fn):
        def call(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + 1e3 * (time.perf_counter() - t)
        return call

    def __enter__(self):
        self.saved = None
        par = getattr(self.eng, "parallel", None)
        if par is not None and not par.single:
            self.saved = (par.broadcast, self.eng.schedule_check)
            par.broadcast = self._timed("command broadcast", par.broadcast)
            self.eng.schedule_check = self._timed("schedule check", self.eng.schedule_check)
        return self

    def __exit__(self, *exc):
        if self.saved:
            par = self.eng.parallel
            del par.broadcast          # the instance attribute: the class's method again
            self.eng.schedule_check = self.saved[1]


def worker(a) -> None:
    from hybridkv.engine import LLM, SamplingParams
    cuda = a.device.startswith("cuda")
    world, ep = parse_layout(a.layout)
    cells, _ = workload(a)
    routing = json.loads(Path(a.routing).read_text()) if a.routing else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    llm = LLM(a.ckpt, device=a.device, dtype=torch.bfloat16 if cuda else torch.float32, kv_format="fp8",
              num_blocks=pool_blocks(a, cells, []), max_num_seqs=max([b for b, _ in cells] + [1]),
              max_num_batched_tokens=a.chunk, enable_prefix_caching=False, async_scheduling=a.async_scheduling,
              tensor_parallel_size=world, expert_parallel_size=ep)
    eng, model = llm.engine, llm.engine.model          # rank 0's engine and shard
    cfg = model.config
    wb = weight_bytes(model)
    ckpt = json.loads((Path(a.ckpt) / INDEX_FILE).read_text())["metadata"]["total_size"]
    emit(dict(kind="memory", layout=a.layout, world=world, layers=cfg.num_hidden_layers, checkpoint_bytes=ckpt,
              kv_pool_bytes=sum(eng.store.nbytes_by_kind().values()),
              rank0_after_load_bytes=torch.cuda.memory_allocated() - base if cuda else None,
              gpus_after_load_bytes=gpu_memory_used() if cuda else None,
              non_expert_bytes=wb["non_expert"], expert_bytes=wb["expert"]))
    g = torch.Generator().manual_seed(0)
    for b, ctx in cells:
        budget = decode_budget(a, b, ctx)
        ctx = min(ctx, eng.max_model_len - budget)
        seqs = [eng.add_request(torch.randint(2, cfg.vocab_size, (ctx,), generator=g).tolist(),
                                SamplingParams(max_tokens=budget, ignore_eos=True)) for _ in range(b)]
        prefill_steps, preempted = 0, eng.scheduler.num_preemptions
        while any(s.first_token_time is None for s in seqs):
            eng.step()
            prefill_steps += 1
        timed_steps(eng, WARM_STEPS, a.device)
        with HostTimers(eng) as host:
            wall = steps_back_to_back(eng, a.steps, a.device) / a.steps
        busy, _, top, fams = device_ms(lambda: steps_back_to_back(eng, a.steps, a.device), cuda)
        ended = sum(s.finish_reason is not None for s in seqs)
        preempted = eng.scheduler.num_preemptions - preempted
        if ended or preempted:
            raise RuntimeError(f"B={b} x {ctx:,}: {ended} requests ended and {preempted} were preempted before the "
                               f"measurement ended (prefill took {prefill_steps} steps)")
        if world == 1:                                 # an eager step with hooks on the gates
            graphs, eng.graphs = eng.graphs, None
            timed_steps(eng, 1, a.device)
            counter = ExpertCounter(model)
            timed_steps(eng, 1, a.device)
            counter.close()
            eng.graphs = graphs
            per_layer = counter.per_layer
        else:                                          # the one-GPU layout's (see the docstring)
            per_layer = [set(s) for s in routing.get(f"{b},{ctx}", [])]
        experts = busiest_rank_experts(per_layer, cfg.n_routed_experts, world, ep == world) if per_layer else None
        must = (wb["non_expert"] + experts * wb["expert"] + b * kv_read_bytes(cfg, ctx, cfg.index_topk)
                if experts is not None else None)
        bytes_ms = must / a.bandwidth * 1e3 if must else None
        dev = busy / a.steps if busy is not None else None
        emit(dict(kind="decode", layout=a.layout, world=world, batch=b, context=ctx, prefill_steps=prefill_steps,
                  wall_ms=1e3 * wall, tok_s=b / wall, device_ms=dev,
                  nccl_ms=fams.get(COMMUNICATION, 0.0) / a.steps if cuda else None,
                  must_read_bytes=must, experts_selected=sum(len(s) for s in per_layer), busiest_rank_experts=experts,
                  bytes_ms=bytes_ms, ratio=dev / bytes_ms if dev is not None and bytes_ms else None,
                  host_ms_per_step={k: v / a.steps for k, v in host.ms.items()},
                  graph_steps=eng.stats.graph_steps, queued_steps=eng.stats.queued_steps, top=top[:40],
                  families={k: v / a.steps for k, v in fams.items()},
                  routing=[sorted(s) for s in per_layer] if world == 1 else None))
        for s in seqs:
            eng.abort(s.request_id)
    if cuda:
        emit(dict(kind="peak", layout=a.layout, rank0_peak_bytes=torch.cuda.max_memory_allocated() - base,
                  gpus_after_bytes=gpu_memory_used()))
    llm.close()


def report(rows: list[dict], a) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: not a result)"
    print(f"\n# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {torch.cuda.device_count()} × {dev}, torch "
          f"{torch.__version__}; command: python benchmarks/engine_multi_gpu.py {' '.join(sys.argv[1:])}")
    one = {(r["batch"], r["context"]): r for r in rows if r["kind"] == "decode" and r["world"] == 1}
    print("\n| layout | batch | context | tok/s | wall ms | device ms (rank 0) | NCCL ms | must read (busiest rank) "
          "| bytes ms | device/bytes | speedup | efficiency |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] != "decode":
            continue
        base = one.get((r["batch"], r["context"]))
        speedup = base["device_ms"] / r["device_ms"] if base and base["device_ms"] and r["device_ms"] else None
        print(f"| {r['layout']} | {r['batch']} | {r['context']:,} | {r['tok_s']:.1f} | {r['wall_ms']:.2f} | "
              f"{fmt(r['device_ms'])} | {fmt(r['nccl_ms'], '.3f')} | {fmt_bytes(r['must_read_bytes'])} | "
              f"{fmt(r['bytes_ms'], '.3f')} | {fmt(r['ratio'])} | {fmt(speedup)} | "
              f"{fmt(speedup / r['world'] if speedup else None)} |")
    print("\nDevice ms of one decode step on rank 0 by operator family:\n")
    for r in rows:
        if r["kind"] == "decode" and r.get("families"):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["families"].items())
            print(f"- {r['layout']} B={r['batch']} ctx={r['context']:,}: {parts}")
            if r.get("host_ms_per_step"):
                print("  host ms per step on the leader: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r["host_ms_per_step"].items()))
    print("\n| layout | blocks | checkpoint | KV pool (per rank) | rank 0 after load | rank 0 peak | "
          "GPUs' memory.used after load | after the cells |")
    print("|---|---|---|---|---|---|---|---|")
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mem = next((r for r in rows if r["kind"] == "memory" and r["layout"] == layout), None)
        peak = next((r for r in rows if r["kind"] == "peak" and r["layout"] == layout), {})
        if mem:
            used = ", ".join(fmt_bytes(x) for x in mem["gpus_after_load_bytes"] or [])
            after = ", ".join(fmt_bytes(x) for x in peak.get("gpus_after_bytes") or [])
            print(f"| {layout} | {mem['layers']} | {fmt_bytes(mem['checkpoint_bytes'])} | "
                  f"{fmt_bytes(mem['kv_pool_bytes'])} | {fmt_bytes(mem['rank0_after_load_bytes'])} | "
                  f"{fmt_bytes(peak.get('rank0_peak_bytes'))} | {used or '—'} | {after or '—'} |")
    for r in rows:
        if r["kind"] == "failed":
            print(f"- {r['layout']}: {r['why']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (written there if missing)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--layouts", default="1,ep2,tp2", help="1, epN (whole experts per rank), tpN (experts' width "
                    "split); each in its own process")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4k,128k")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-tokens", type=_parse_count, default=None,
                    help="leave out the decode cells whose batch x context exceeds this (their prefill is long)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per engine step")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bandwidth", type=float, default=4.13e12, help="bytes/s of one GPU the byte time is counted at")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model, gloo ranks on the CPU, to check the script")
    ap.add_argument("--layout", default=None, help=argparse.SUPPRESS)     # a worker's layout
    ap.add_argument("--routing", default=None, help=argparse.SUPPRESS)    # layout 1's experts per cell (json)
    a = ap.parse_args()
    a.million, a.prefill = False, ""       # engine_gpu.workload's other cells: not measured here
    if a.smoke:
        a.device, a.layers, a.steps, a.chunk = "cpu", 2, 2, 512
        a.batches, a.contexts, a.layouts = "1,2", "300", "1,ep2"
        a.ckpt = a.ckpt or str(Path(tempfile.gettempdir()) / "hybridkv-engine-gpu-smoke")
    if a.ckpt is None:
        ap.error("--ckpt DIR is required (the checkpoint is written there once and reused)")
    for name in a.layouts.split(","):
        try:
            parse_layout(name)
        except ValueError as e:
            ap.error(str(e))
    if a.layout:
        worker(a)
        return 0
    ensure_checkpoint(a)
    rows: list[dict] = []
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    cells: dict[str, list] = {}            # layout 1's experts per cell, for the layouts after it

    def keep_routing(row: dict) -> None:
        if row.get("routing"):
            cells[f"{row['batch']},{row['context']}"] = row.pop("routing")
            routing.write_text(json.dumps(cells))

    with tempfile.TemporaryDirectory() as tmp:
        routing = Path(tmp) / "routing.json"
        for layout in a.layouts.split(","):
            cmd = [sys.executable, __file__, "--layout", layout] + sys.argv[1:]
            if layout != "1" and cells:
                cmd += ["--routing", str(routing)]
            code = collect_rows(cmd, env, rows, a.json, keep_routing)
            if code:
                rows.append(dict(kind="failed", layout=layout, why=f"exit {code}; its rows so far are kept"))
                print(f"# layout {layout} failed (exit {code})", flush=True)
    report(rows, a)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
