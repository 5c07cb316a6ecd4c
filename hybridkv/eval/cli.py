"""`hybridkv eval MODEL_DIR ...`, `hybridkv eval compare A.json B.json`, `hybridkv eval report R.json`
and `hybridkv eval merge A.json B.json ... --out DIR`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hybridkv.engine.config import EngineConfig, engine_options
from hybridkv.eval.report import compare, load, load_with_command, markdown, merge, plots
from hybridkv.eval.runner import build_samples, run_policy
from hybridkv.eval.tasks import HAYSTACKS, REALTEXT, expand_tasks


def _lengths(text: str) -> list[int]:
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        out.append(int(float(t[:-1]) * 1024) if t.endswith("k") else int(t))
    return out


def _load(parser: argparse.ArgumentParser, path: str, with_command: bool = False):
    """The runs of a results.json (and, `with_command`, the command that wrote it), or a usage error
    that names the file and what is wrong with it."""
    try:
        return load_with_command(path) if with_command else load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"cannot read evaluation results from {path}: {type(e).__name__}: {e}")


def _run_cells_in_workers(a, argv: list[str], tasks: list[str], lengths: list[int]) -> list:
    """Every (task, length) cell as its own `hybridkv eval` process, `a.workers` at a time (longest
    prompts first), each with `a.threads_per_worker` threads; the parts merged. A cell's prompts
    depend only on (task, length, sample, seed), so the result is the one a single process gives.
    Each worker gets this command line with its cell's options last (the last of an option wins)."""
    import os
    import subprocess
    import tempfile
    import time

    threads = a.threads_per_worker or max(1, (os.cpu_count() or 1) // a.workers)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    cells = sorted(((t, n) for t in tasks for n in lengths), key=lambda c: -c[1])
    with tempfile.TemporaryDirectory(prefix="hybridkv-eval-") as tmp:
        pending, running, done, failed = list(enumerate(cells)), {}, [], []
        while pending or running:
            while pending and len(running) < a.workers:
                i, (task, length) = pending.pop(0)
                out = Path(tmp) / f"cell{i}"
                cmd = [sys.executable, "-m", "hybridkv.cli", "eval", *argv, "--tasks", task, "--lengths",
                       str(length), "--out", str(out), "--workers", "1"]
                log = open(Path(tmp) / f"cell{i}.log", "w")
                running[i] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), out, log,
                              (task, length))
            time.sleep(0.2)
            for i, (proc, out, log, cell) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[i]
                if proc.returncode == 0:
                    done.append(load(out / "results.json"))
                    print(f"cell {cell[0]} at {cell[1]} done ({len(done)}/{len(cells)})", file=sys.stderr)
                else:
                    tail = (Path(tmp) / f"cell{i}.log").read_text()[-2000:]
                    failed.append(f"{cell[0]} at {cell[1]} (exit {proc.returncode}):\n{tail}")
        if failed:
            raise RuntimeError("evaluation cells failed: " + "\n".join(failed))
    runs = merge(done)
    for r in runs:   # the order asked for, not the order the cells finished in
        r.tasks = [t for t in tasks if t in r.tasks]
        r.lengths = sorted(r.lengths)
    return runs


# engine options the evaluation sets itself unless told: the device pool, the longest request and
# the step budget are sized to its prompts (None), fewer requests run at once, and no prefix-cache
# tier below the device keeps what the prompts computed
ENGINE_DEFAULTS = dict(num_blocks=None, max_model_len=None, max_num_batched_tokens=None, max_num_seqs=8,
                       kv_dram_size="0")


def build_parser() -> argparse.ArgumentParser:
    """The parser of `hybridkv eval MODEL_DIR ...` (an evaluation run)."""
    p = argparse.ArgumentParser(prog="hybridkv eval", description="long-context evaluation through the engine")
    p.add_argument("model_dir")
    p.add_argument("--tasks", default="ruler,mrcr,passkey",
                   help="suites (ruler, mrcr, passkey, realtext) or task names")
    p.add_argument("--haystack", choices=HAYSTACKS, default="synthetic",
                   help="realtext: the needle tasks over held-out real prose (passkey -> passkey_realtext; "
                        "suites keep the tasks that have such a haystack)")
    p.add_argument("--lengths", default="4k,8k,16k,32k")
    p.add_argument("--samples", type=int, default=10, help="prompts per task and length")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the model directory's)")
    p.add_argument("--out", default=None, help="output directory (default: MODEL_DIR/eval)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts (default: %(default)s)")
    p.add_argument("--workers", type=int, default=1,
                   help="run each (task, length) cell as its own process, this many at a time")
    p.add_argument("--threads-per-worker", type=int, default=None,
                   help="torch threads of each worker (default: the CPU count / workers)")
    EngineConfig.add_arguments(p)
    p.set_defaults(**ENGINE_DEFAULTS)
    return p


def main(argv: list[str]) -> int:
    if argv and argv[0] == "compare":
        p = argparse.ArgumentParser(prog="hybridkv eval compare")
        p.add_argument("a")
        p.add_argument("b")
        p.add_argument("--labels", default=None, help="column names, comma separated (default: the JSONs' folders)")
        a = p.parse_args(argv[1:])
        if a.labels:
            labels = a.labels.split(",", 1)
            if len(labels) != 2 or labels[0] == labels[1]:
                p.error("--labels needs two different names, e.g. --labels v4,v41")
        else:
            labels = [Path(a.a).parent.name or "A", Path(a.b).parent.name or "B"]
            if labels[0] == labels[1]:
                labels = [Path(a.a).stem + " (A)", Path(a.b).stem + " (B)"]
        print(compare(_load(p, a.a), _load(p, a.b), *labels))
        return 0
    if argv and argv[0] == "report":
        p = argparse.ArgumentParser(prog="hybridkv eval report",
                                    description="the table and plots of a results.json again (after a plot changed)")
        p.add_argument("results")
        p.add_argument("--out", default=None, help="directory for the plots (default: the JSON's)")
        a = p.parse_args(argv[1:])
        runs = _load(p, a.results)
        written = plots(runs, Path(a.out) if a.out else Path(a.results).parent)
        print(markdown(runs))
        print(f"wrote {len(written)} plots", file=sys.stderr)
        return 0
    if argv and argv[0] == "merge":
        p = argparse.ArgumentParser(prog="hybridkv eval merge",
                                    description="one results.json from evaluations of one model split by task "
                                                "or length (several processes or machines)")
        p.add_argument("results", nargs="+")
        p.add_argument("--out", required=True, help="directory for results.json, results.md and the plots")
        a = p.parse_args(argv[1:])
        parts = [_load(p, r, with_command=True) for r in a.results]
        try:
            runs = merge([runs for runs, _ in parts])
        except ValueError as e:
            p.error(str(e))
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        commands = [command for _, command in parts]
        (out / "results.json").write_text(json.dumps({"command": " ; ".join(commands) + " ; hybridkv eval "
                                                      + " ".join(argv), "runs": [r.to_json() for r in runs]},
                                                     indent=1))
        (out / "results.md").write_text("\n".join(f"`{c}`" for c in commands) + "\n\n" + markdown(runs))
        written = plots(runs, out)
        print(markdown(runs))
        print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {len(written)} plots", file=sys.stderr)
        return 0
    p = build_parser()
    a = p.parse_args(argv)
    if a.workers < 1:
        p.error("--workers must be at least 1")
    from tqdm import tqdm

    from hybridkv.tasks.tokenizer import TaskTokenizer

    tok = TaskTokenizer.load(a.tokenizer or a.model_dir)
    try:
        tasks = expand_tasks(a.tasks, a.haystack)
    except ValueError as e:
        p.error(str(e))
    lengths = _lengths(a.lengths)
    header = {}
    if set(tasks) & set(REALTEXT):     # which text the haystacks were (it depends on the Python release)
        from hybridkv.tasks import prose
        header["haystack_text"] = prose.describe("eval")
        print(header["haystack_text"], file=sys.stderr)
    options = engine_options(a)
    policies = [x.strip() for x in options.pop("memory_policy").split(",") if x.strip()]
    for policy in policies:     # a bad option fails now, not after the prompts and the first runs
        EngineConfig(**options, memory_policy=policy)
    if a.workers > 1:
        runs = _run_cells_in_workers(a, argv, tasks, lengths)
    else:
        total = len(tasks) * len(lengths) * a.samples
        with tqdm(total=total, desc="generating prompts", unit="prompt") as bar:
            samples = build_samples(tok, tasks, lengths, a.samples, a.seed, progress=bar.update)
        runs = []
        for policy in policies:
            with tqdm(total=len(samples), desc=f"policy {policy}", unit="req") as bar:
                runs.append(run_policy(a.model_dir, policy, samples, tok, tasks, lengths, a.samples, a.device,
                                       progress=bar.update, dtype=a.dtype, **options))
    out = Path(a.out) if a.out else Path(a.model_dir) / "eval"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": "hybridkv eval " + " ".join(argv), **header,
                                                  "runs": [r.to_json() for r in runs]}, indent=1))
    table = markdown(runs)
    text_line = f"{header['haystack_text']}\n\n" if header else ""
    (out / "results.md").write_text(f"`hybridkv eval {' '.join(argv)}`\n\n{text_line}" + table)
    written = plots(runs, out)
    print(table)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and {len(written)} plots", file=sys.stderr)
    return 0
