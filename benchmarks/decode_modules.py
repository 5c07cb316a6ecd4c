"""Where one GPU decode step's device time goes, by kernel and by model module.

Serves a checkpoint (e.g. the real-width stack of `benchmarks/engine_gpu.py`), prefills `--batch`
requests of `--context` random tokens, then:
- profiles `--steps` CUDA-graph-replayed decode steps: every kernel's device ms and launches per step;
- runs one eager step with each module's forward annotated and attributes every kernel to the
  innermost module whose forward launched it (through the launch's runtime or driver call).

With `--speculative K` the steps are speculative ones (the MTP block drafting K tokens, each step
one replay of `engine/spec_graphs.py`'s graph); the eager pass then runs that graph's forward
uncaptured, with the verify, acceptance, rollback and drafting stages named beside the modules.

    python3 benchmarks/decode_modules.py --ckpt /tmp/v4flash-8 [--kv-format fp8|v41|bf16] [--batch 1]
        [--context 4k] [--steps 8] [--trace OUT.json.gz] [--speculative K]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.engine import LLM, SamplingParams  # noqa: E402
from decode_context import replay_ms  # noqa: E402  (this folder is on sys.path)


def steps(eng, n: int) -> None:
    for _ in range(n):
        eng.step()
    torch.cuda.synchronize()


def annotate(model) -> list:
    """A profiler range named after each module (indices folded: layers.#.attn) around its forward."""
    handles = []
    for name, m in model.named_modules():
        if not name:
            continue
        key = "M:" + re.sub(r"\.\d+", ".#", name)

        def pre(mod, _inp, key=key):
            mod._profile_range = record_function(key)
            mod._profile_range.__enter__()

        def post(mod, _inp, _out):
            mod._profile_range.__exit__(None, None, None)
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    return handles


def annotate_stages(spec_graphs) -> None:
    """A profiler range around each stage of the speculative graph's forward (on the instance)."""
    for name in ("_verify", "_accept", "_rollback", "_draft", "_pick"):
        method = getattr(spec_graphs, name)

        def ranged(*args, method=method, key=f"M:spec{name}", **kw):
            with record_function(key):
                return method(*args, **kw)
        setattr(spec_graphs, name, ranged)


def by_module(trace: dict, top: int) -> None:
    ev = trace["traceEvents"]
    ranges = collections.defaultdict(list)
    for e in ev:
        if e.get("cat") == "user_annotation" and e.get("name", "").startswith("M:"):
            ranges[e["tid"]].append((e["ts"], e["ts"] + e["dur"], e["name"][2:]))
    launches = {e["args"]["correlation"]: e for e in ev
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ms, count = collections.Counter(), collections.Counter()
    kernels = collections.defaultdict(collections.Counter)
    for k in ev:
        if k.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launch = launches.get(k.get("args", {}).get("correlation"))
        where = "(outside any module)"
        if launch is not None:
            inside = [r for r in ranges.get(launch["tid"], []) if r[0] <= launch["ts"] <= r[1]]
            if inside:
                where = min(inside, key=lambda r: r[1] - r[0])[2]
        ms[where] += k["dur"] / 1e3
        count[where] += 1
        kernels[where][k["name"][:60]] += k["dur"] / 1e3
    print(f"\neager step: {sum(ms.values()):.3f} ms of kernels in {sum(count.values())} launches\n")
    print("| module | device ms | launches | largest kernels |\n|---|---|---|---|")
    for where, t in ms.most_common(top):
        largest = "; ".join(f"{n} {v:.3f}" for n, v in kernels[where].most_common(3))
        print(f"| {where} | {t:.3f} | {count[where]} | {largest} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", default="4k")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--kv-format", default="fp8", choices=["bf16", "fp8", "v41"])
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--trace", default=None, help="also write the eager step's trace (gzipped JSON)")
    ap.add_argument("--speculative", type=int, default=0, metavar="K", help="speculative steps drafting K tokens")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs CUDA")
    ctx = _parse_count(a.context)
    llm = LLM(a.ckpt, device="cuda", dtype=torch.bfloat16, kv_format=a.kv_format, num_blocks=a.batch * (ctx + 256) // 128 + 16,
              max_num_seqs=a.batch, max_num_batched_tokens=8192, enable_prefix_caching=False,
              **(dict(speculative="mtp", num_speculative_tokens=a.speculative) if a.speculative else {}))
    eng, model = llm.engine, llm.engine.model
    g = torch.Generator().manual_seed(0)
    seqs = [eng.add_request(torch.randint(2, model.config.vocab_size, (ctx,), generator=g).tolist(),
                            # early requests decode while the rest prefill: room for that too
                            SamplingParams(max_tokens=(2 * a.steps + 16) * (a.speculative + 1)
                                           + -(-a.batch * ctx // 8192) + 1,
                                           ignore_eos=True)) for _ in range(a.batch)]
    while any(s.first_token_time is None for s in seqs):
        eng.step()
    steps(eng, 4)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        steps(eng, a.steps)
    ka = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    busy = sum(e.self_device_time_total for e in ka) / 1e3 / a.steps
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; command: python3 benchmarks/decode_modules.py "
          f"{' '.join(sys.argv[1:])}\n\nB={a.batch}, context {ctx:,}: {busy:.3f} ms device per graph-replayed step\n")
    replay = replay_ms(eng)
    if replay is not None:
        print(f"graph replay back to back: {replay:.3f} ms a step between events; the {replay - busy:.3f} ms "
              f"beyond the kernels' own time are the gaps between launches\n")
    print("| kernel | device ms / step | launches / step |\n|---|---|---|")
    for e in sorted(ka, key=lambda e: -e.self_device_time_total)[:a.top]:
        print(f"| {e.key[:90]} | {e.self_device_time_total / 1e3 / a.steps:.3f} | {e.count / a.steps:.1f} |")
    if a.speculative:
        # the last replayed graph's forward, uncaptured (it redoes that step's writes; nothing runs after)
        sg = eng.spec_graphs
        g = next(reversed(sg.graphs.values()))
        annotate_stages(sg)

        def one_eager_step():
            with torch.inference_mode():
                sg._forward(g)
            torch.cuda.synchronize()
    else:
        graphs, eng.graphs = eng.graphs, None

        def one_eager_step():
            steps(eng, 1)
    one_eager_step()                                # eager shapes compiled outside the profile
    handles = annotate(model)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_eager_step()
    for h in handles:
        h.remove()
    if not a.speculative:
        eng.graphs = graphs
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        raw = Path(f.name).read_bytes()
    if a.trace:
        Path(a.trace).write_bytes(gzip.compress(raw))
    by_module(json.loads(raw), a.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
