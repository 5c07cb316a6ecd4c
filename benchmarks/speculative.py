"""Speculative decoding with the MTP block against plain decoding, in the same run.

    python benchmarks/speculative.py [--model models/tiny-v4] [--ks 1,2,3] [--batches 1,8]
                                     [--context 1024] [--cpu-time] [--mtp-stats 8] [--json OUT]
                                     [--verify auto|waves|segments|both] [--replay-ms]
                                     [--temperature T --top-p P]

Workloads, greedy: "needle" = pass-key and single-needle prompts (`hybridkv.tasks`), decoding their
answers (the model stops at its EOS); "free text" = a haystack of filler sentences without a
question, continued for `--free-tokens` tokens (ignore_eos). For every workload, batch and k
(0 = no speculation): decode tokens/s (tokens after each request's first, over the decode steps'
time; `--prompts` prompts in groups of the batch size, each group's fastest of `--repeats` runs,
the settings taking turns within each repeat),
the mean acceptance length (tokens per verify step: 1 + accepted / drafts), the draft acceptance
rate, how many decode steps replayed CUDA graphs ("graphed": plain decode graphs, or the speculative
step's, engine/spec_graphs.py; the CPU runs none), whether the outputs equal plain decoding's, and
how far the logits are from plain decoding's
(the largest |difference| of each token's logits, max and median over the tokens both runs share).

`--mtp-stats N` also measures the MTP block itself on N training-distribution rows of `--context`
tokens (teacher forcing through the reference path): its loss (cross-entropy of token t+2 at
position t), its top-1 accuracy, and how often its argmax equals the main model's argmax for the
same token (what greedy acceptance needs), on answer tokens and on the rest.

`--replay-ms` (CUDA) adds the device time of one step replayed from each setting's CUDA graph at each
batch size: plain decoding's step against the whole speculative step.

`--temperature T [--top-p P]` samples (unseeded) instead: the speculative rows accept by rejection
sampling (on CUDA inside the speculative step's graph), outputs are not compared.

`--cpu-time` times with this process's CPU time (set OMP_NUM_THREADS=1 so that it equals the work),
which other jobs on a shared machine do not inflate.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_context import replay_ms  # noqa: E402  (this folder is on sys.path)
from hybridkv.engine import LLM, SamplingParams  # noqa: E402
from hybridkv.tasks.generators import Pools, make_sample, training_example  # noqa: E402
from hybridkv.tasks.tokenizer import TaskTokenizer  # noqa: E402

clock = time.perf_counter


def workloads(tok: TaskTokenizer, context: int, n: int, free_tokens: int) -> dict[str, tuple[list, SamplingParams]]:
    pools = Pools(tok, seed=0)
    tasks = ["passkey", "niah_single_1", "niah_single_2", "niah_single_3"]
    needle = [make_sample(tasks[i % len(tasks)], 1000 + i, pools, context, depth=(i + 0.5) / n).prompt
              for i in range(n)]
    rng = np.random.default_rng(7)
    free = []
    for _ in range(n):
        filler, _ = pools.sentences.fill(rng, context - 1)
        free.append([tok.bos_id, *filler.astype(int).tolist()])
    return {"needle": (needle, SamplingParams(max_tokens=64)),
            "free text": (free, SamplingParams(max_tokens=free_tokens, ignore_eos=True))}


def measure(llms: list[LLM], prompts: list[list[int]], params: SamplingParams, batch: int, repeats: int) -> list[dict]:
    """`decode_run` of every engine over the prompts in groups of `batch`, `repeats` times, the
    engines taking turns within each repeat (so that a slower stretch of a shared machine falls on all
    of them alike): for each engine, tokens/s from each group's fastest repeat. The first repeat keeps
    every token's logits (for `logit_gap`), a copy per token that a server does not make: with two
    repeats or more it is not timed."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    runs = [[[] for _ in groups] for _ in llms]
    for r in range(repeats):
        for g, group in enumerate(groups):
            for m, llm in enumerate(llms):
                runs[m][g].append(decode_run(llm, group, params, record_logits=r == 0))
    return [summarise(r) for r in runs]


def summarise(runs: list[list[dict]]) -> dict:
    """One engine's runs, [group][repeat]: tokens/s from each group's fastest repeat after the first
    (the first alone where there is one), acceptance from the first repeats, the outputs and logits
    of the first repeats, and whether the repeats agree."""
    best = [min(r[1:] or r, key=lambda x: x["seconds"]) for r in runs]
    seconds, tokens = sum(b["seconds"] for b in best), sum(b["decode_tokens"] for b in best)
    first = [r[0] for r in runs]
    drafts = sum(x["drafts"] for x in first)
    drafted, accepted = sum(x["drafted"] for x in first), sum(x["accepted"] for x in first)
    return {"tokens_per_s": tokens / seconds, "decode_tokens": tokens, "seconds": seconds,
            "steps": sum(b["steps"] for b in best), "graphed_steps": sum(b["graphed"] for b in best),
            "acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / drafted if drafted else None,
            "outputs": [o for x in first for o in x["outputs"]], "logits": [lg for x in first for lg in x["logits"]],
            "repeats_agree": all(x["outputs"] == r[0]["outputs"] for r in runs for x in r)}


def decode_run(llm: LLM, prompts: list[list[int]], params: SamplingParams, record_logits: bool = True) -> dict:
    """Prefill every prompt (one step: the budget holds them all), then time the decode steps; with
    `record_logits` every token's logits are kept (`logits`: empty lists without)."""
    eng = llm.engine
    eng.prefix.clear_device()
    before = (eng.stats.spec_drafts, eng.stats.spec_draft_tokens, eng.stats.spec_accepted_tokens)
    eng.record_logits = record_logits
    seqs = [eng.add_request(p, params) for p in prompts]
    while eng.scheduler.waiting or any(s.first_token_time is None for s in seqs):
        eng.step()
    first = sum(len(s.output_ids) for s in seqs)
    graphed = eng.stats.graph_steps + eng.stats.spec_graph_steps
    t, steps = clock(), 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    dt = clock() - t
    produced = sum(len(s.output_ids) for s in seqs) - first
    drafts, drafted, accepted = (a - b for a, b in zip((eng.stats.spec_drafts, eng.stats.spec_draft_tokens,
                                                        eng.stats.spec_accepted_tokens), before))
    graphed = eng.stats.graph_steps + eng.stats.spec_graph_steps - graphed
    return {"decode_tokens": produced, "steps": steps, "graphed": graphed, "seconds": dt, "drafts": drafts,
            "drafted": drafted,
            "accepted": accepted, "outputs": [s.output_ids for s in seqs], "logits": [s.step_logits for s in seqs]}


def logit_gap(run: dict, base: dict) -> tuple[float, float] | None:
    """Max and median over tokens of the largest |logit difference| from the plain run, over each
    request's tokens up to the first that differs (where both saw the same context); None for the
    plain run itself."""
    gaps = []
    for a, b, out, ref in zip(run["logits"], base["logits"], run["outputs"], base["outputs"]):
        n = next((i for i, (x, y) in enumerate(zip(out, ref)) if x != y), min(len(out), len(ref)))
        gaps += [float((a[i] - b[i]).abs().max()) for i in range(n)]
    if run is base or not gaps:
        return None
    return max(gaps), float(np.median(gaps))


def first_difference(run: dict, base: dict) -> str:
    """Where the outputs first differ, and the baseline's margin between its top two logits there
    (a near tie that a different float rounding order flips) against how far the two logits rows differ."""
    for r, (a, b) in enumerate(zip(run["outputs"], base["outputs"])):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                want, got = base["logits"][r][i], run["logits"][r][i]
                top = torch.topk(want, 2).values
                return (f"request {r} token {i}: {x} for {y}; baseline top-2 margin {float(top[0] - top[1]):.2e}, "
                        f"logits differ by {float((got - want).abs().max()):.2e} (max abs)")
    return "lengths differ"


@torch.inference_mode()
def mtp_stats(model, tok: TaskTokenizer, rows: int, length: int) -> dict:
    """The MTP block on training-distribution rows, teacher-forced through the reference path."""
    from hybridkv.model import ContiguousKV, ForwardBatch

    pools = Pools(tok, seed=0)
    acc = {k: {"loss": 0.0, "top1": 0, "agree": 0, "n": 0, "main_loss": 0.0, "main_top1": 0}
           for k in ("answer", "other")}
    for r in range(rows):
        ids, supervised = training_example(50_000 + r, pools, length, next_document=128)
        x = torch.tensor(ids, dtype=torch.long)
        batch = ForwardBatch.build([(ContiguousKV(model.config), 0, length)])
        h = model(x, batch)
        main = model.logits(h)                                        # row t predicts t + 1
        mb = ForwardBatch.build([(ContiguousKV(model.config), 0, length - 1)])
        m = model.mtp_logits(model.mtp_forward(h[:-1], x[1:], mb))   # row t predicts t + 2
        target = x[2:]
        m = m[:-1]
        loss = torch.nn.functional.cross_entropy(m, target, reduction="none")
        top1 = m.argmax(-1) == target
        agree = m.argmax(-1) == main[1:-1].argmax(-1)
        main_loss = torch.nn.functional.cross_entropy(main[1:-1], target, reduction="none")   # the same tokens
        main_top1 = main[1:-1].argmax(-1) == target
        sup = torch.tensor(supervised[2:])
        for key, mask in (("answer", sup), ("other", ~sup)):
            a = acc[key]
            a["loss"] += float(loss[mask].sum())
            a["top1"] += int(top1[mask].sum())
            a["agree"] += int(agree[mask].sum())
            a["n"] += int(mask.sum())
            a["main_loss"] += float(main_loss[mask].sum())
            a["main_top1"] += int(main_top1[mask].sum())
    return {k: {"mtp_loss": a["loss"] / a["n"], "mtp_top1": a["top1"] / a["n"],
                "agrees_with_main_argmax": a["agree"] / a["n"], "main_loss": a["main_loss"] / a["n"],
                "main_top1": a["main_top1"] / a["n"], "tokens": a["n"]} for k, a in acc.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny-v4")
    ap.add_argument("--ks", default="1,2,3", help="draft lengths to run beside plain decoding")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--free-tokens", type=int, default=64, help="tokens generated per free-text request")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per workload at the smaller batches (run in "
                    "groups of the batch size; a batch larger than this runs that many)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each group; the fastest counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cpu-time", action="store_true", help="time with the process's CPU time")
    ap.add_argument("--mtp-stats", type=int, default=0, metavar="N", help="measure the MTP block on N rows")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--replay-ms", action="store_true",
                    help="CUDA: also the device ms of one replayed step of each setting at each batch size")
    ap.add_argument("--verify", choices=("auto", "waves", "segments", "both"), default="auto",
                    help="how verify rows run (the engine's speculative_verify): auto (the default), as decode rows "
                         "wave by wave, as one segment per request, or waves and segments side by side")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample (unseeded) at this temperature instead of decoding greedily: acceptance by "
                         "rejection sampling; outputs are then not compared")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: the nucleus")
    ap.add_argument("--deterministic", action="store_true",
                    help="batch-invariant execution (hybridkv.ops.backend.deterministic): on a GPU in bf16, the "
                         "setting under which a verify forward of k+1 tokens rounds as k+1 one-token steps do")
    a = ap.parse_args()
    if a.deterministic:
        from hybridkv.ops.backend import set_deterministic
        set_deterministic(True)
    if not Path(a.model).exists() and (ROOT / a.model).exists():
        a.model = str(ROOT / a.model)
    global clock
    if a.cpu_time:
        clock = time.process_time
    ks = [0] + [int(k) for k in a.ks.split(",") if k]
    batches = [int(b) for b in a.batches.split(",")]
    tok = TaskTokenizer.load(Path(a.model) / "tokenizer.json")
    print(f"# {a.model}, context {a.context}, {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {'CPU' if a.cpu_time else 'wall'} time, "
          f"{date.today()}{', deterministic (batch-invariant)' if a.deterministic else ''}")
    results = []
    engines = {}
    modes = ("waves", "segments") if a.verify == "both" else (a.verify,)
    runs = [(0, "-")] + [(k, m) for k in ks if k for m in modes]
    for k, mode in runs:
        opts = dict(speculative="mtp", num_speculative_tokens=k, speculative_verify=mode) if k else {}
        # no host tier: a repeat would restore the prompt's blocks from it and prefill only its tail, in
        # another chunking, which rounds otherwise in bf16 (the GPU's repeats then differed)
        engines[k, mode] = LLM(a.model, device=a.device, num_blocks=16 * max(batches) * (a.context // 128 + 2),
                               max_num_seqs=max(batches), max_num_batched_tokens=max(batches) * (a.context + 4),
                               tiers=None, **opts)
    print(f"{'workload':<10} {'batch':>5} {'k':>2} {'verify':>8} {'decode tok/s':>12} {'speedup':>8} "
          f"{'accept len':>10} {'accept rate':>11} {'tokens':>6} {'graphed':>9} {'same':>5} "
          f"{'logit gap max/median':>21}")
    sets = workloads(tok, a.context, max(*batches, a.prompts), a.free_tokens)
    sampled = a.temperature > 0
    if sampled:
        sets = {name: (prompts, replace(params, temperature=a.temperature, top_p=a.top_p))
                for name, (prompts, params) in sets.items()}
    for batch in batches:
        for name, (prompts, params) in sets.items():
            measured = measure([engines[k, mode] for k, mode in runs], prompts[:max(batch, a.prompts)], params,
                               batch, a.repeats)
            base = measured[0]                  # k = 0
            for (k, mode), r in zip(runs, measured):
                same = None if sampled else r["outputs"] == base["outputs"]
                speedup = r["tokens_per_s"] / base["tokens_per_s"]
                al = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
                ar = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
                gap = None if sampled else logit_gap(r, base)
                gaps = "-" if gap is None else f"{gap[0]:.1e}/{gap[1]:.1e}"
                print(f"{name:<10} {batch:>5} {k:>2} {mode:>8} {r['tokens_per_s']:>12.1f} {speedup:>7.2f}x {al:>10} "
                      f"{ar:>11} {r['decode_tokens']:>6} {r['graphed_steps']:>4}/{r['steps']:<4} "
                      f"{'-' if same is None else 'yes' if same else 'NO':>5} {gaps:>21}", flush=True)
                if not r["repeats_agree"] and not sampled:
                    print("    repeats of a group gave different outputs", flush=True)
                if same is False:
                    print(f"    outputs differ: {first_difference(r, base)}", flush=True)
                results.append({"workload": name, "batch": batch, "k": k, "verify": mode, "speedup": speedup,
                                "same_outputs": same, "logit_gap_max_median": gap,
                                **{key: v for key, v in r.items() if key not in ("outputs", "logits")}})
        if a.replay_ms:
            ms = {f"k={k} {mode}": replay_ms(engines[k, mode].engine, 50, batch) for k, mode in runs}
            base = ms["k=0 -"]
            print(f"batch {batch}, device ms of one replayed step: " + (", ".join(
                f"{name} {v:.3f}" + (f" ({v / base:.2f}x k=0)" if base and name != "k=0 -" else "")
                for name, v in ms.items() if v is not None) or "no CUDA graph replayed"), flush=True)
            results.append({"batch": batch, "replay_ms": ms})
    out = {"model": a.model, "context": a.context, "date": str(date.today()), "deterministic": a.deterministic,
           "temperature": a.temperature, "top_p": a.top_p,
           "threads": torch.get_num_threads(),
           "clock": "cpu" if a.cpu_time else "wall", "machine": platform.platform(), "rows": results,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if a.mtp_stats:
        stats = mtp_stats(engines[0, "-"].model, tok, a.mtp_stats, a.context)
        out["mtp"] = stats
        for key, s in stats.items():
            print(f"MTP on {key} tokens ({s['tokens']}): loss {s['mtp_loss']:.3f}, top-1 {s['mtp_top1']:.3f}, "
                  f"agrees with the main model's argmax {s['agrees_with_main_argmax']:.3f}; the main model on the "
                  f"same tokens (one step later): loss {s['main_loss']:.3f}, top-1 {s['main_top1']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
