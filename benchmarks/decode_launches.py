"""How many launches one decode step makes, and where from, without a GPU.

Runs the engine on the CPU with the GPU's dispatch: `HYBRIDKV_KERNELS=triton` with Triton's
interpreter, the store's kernel formats set and the decode-graph forward (not captured). One decode
step is then counted: every torch operator that launches work (views and allocations left out) and
every Triton kernel, each attributed to the innermost hybridkv function outside `hybridkv/ops`
and to the function that issued it. A GPU replays the same launches from its CUDA graph, so the
counts say where a step's launches come from before a GPU is asked for (`decode_modules.py` then
gives their device time on one). A `flatten`, `to`, `contiguous` or `reshape` counts only where it
copies (on the CPU's float32 model a cast the GPU's bf16 one makes may be a no-op, and is not
counted).

With `--speculative K` the counted step is a speculative one (the MTP block drafting K tokens,
engine/spec_graphs.py's verify, acceptance, rollback and drafting, uncaptured), to set beside the
plain step's count.

    python benchmarks/decode_launches.py --model tests/fixtures/v41-tiny-fp8 --kv-format v41 [--top 40]
        [--ops 0] [--context 300] [--speculative K]
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"           # before triton is imported
os.environ["HYBRIDKV_KERNELS"] = "triton"

import argparse  # noqa: E402
import collections  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.engine import LLM, SamplingParams  # noqa: E402
from hybridkv.engine.graphs import DecodeGraphs  # noqa: E402
from hybridkv.engine.spec_graphs import SpeculativeGraphs  # noqa: E402

# operators that launch nothing on a GPU: views, metadata, allocations
NO_LAUNCH = {"detach", "view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "as_strided",
             "slice", "select", "reshape", "alias", "permute", "unflatten", "split", "unbind", "chunk", "narrow",
             "lift_fresh", "empty", "empty_like", "empty_strided", "_reshape_alias", "split_with_sizes",
             "view_as_real", "_local_scalar_dense", "is_nonzero", "item", "sym_size", "sym_stride", "sym_numel"}


# operators that launch a copy only where they cannot return their input or a view of it (a
# contiguous tensor flattened, a float32 tensor cast to float32): counted only then
VIEW_IF_ABLE = {"flatten", "to", "contiguous", "reshape", "type_as"}


def _same_storage(out, args) -> bool:
    return (isinstance(out, torch.Tensor) and bool(args) and isinstance(args[0], torch.Tensor)
            and out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr())


def call_site() -> str:
    """'caller <- issuer': the innermost hybridkv function outside hybridkv/ops, and the innermost."""
    inner = None
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/hybridkv/" not in frame.filename:
            continue
        name = frame.filename.split("/hybridkv/")[1].removesuffix(".py") + ":" + frame.name
        inner = inner or name
        if not name.startswith("ops/"):
            return f"{name} <- {inner}"
    return f"? <- {inner}"


class LaunchCensus(TorchDispatchMode):
    """Counts launching torch operators and (with `count_triton`) Triton kernels while `on`."""

    def __init__(self):
        super().__init__()
        self.on = False
        self.sites: collections.Counter = collections.Counter()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        out = func(*args, **(kwargs or {}))
        if self.on and name not in NO_LAUNCH and not (name in VIEW_IF_ABLE and _same_storage(out, args)):
            site = call_site()
            self.sites[site] += 1
            self.ops[(site, name)] += 1
        return out

    def count_triton(self):
        """Count each interpreted Triton launch once (its own torch work inside is not counted)."""
        run, census = InterpretedFunction.run, self

        def counted(fn, *args, **kwargs):
            if not census.on:
                return run(fn, *args, **kwargs)
            site = f"{call_site()} [{fn.fn.__name__}]"
            census.sites[site] += 1
            census.ops[(site, fn.fn.__name__)] += 1
            census.on = False
            try:
                return run(fn, *args, **kwargs)
            finally:
                census.on = True
        InterpretedFunction.run = counted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v41-tiny-fp8"))
    ap.add_argument("--kv-format", default="v41", choices=["fp8", "v41", "bf16"])
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the counted step")
    ap.add_argument("--top", type=int, default=40, help="call sites listed")
    ap.add_argument("--ops", type=int, default=0, help="also list the N most frequent (site, operator) pairs")
    ap.add_argument("--speculative", type=int, default=0, metavar="K",
                    help="count a speculative step with the MTP block drafting K tokens")
    a = ap.parse_args()
    spec = dict(speculative="mtp", num_speculative_tokens=a.speculative) if a.speculative else {}
    llm = LLM(a.model, device="cpu", dtype=torch.float32, kv_format=a.kv_format, num_blocks=64, max_num_seqs=4,
              max_num_batched_tokens=2048, enable_prefix_caching=False, **spec)
    eng = llm.engine
    # the formats CUDA picks for this store, and the decode graphs' forward, uncaptured
    eng.store.kernel_formats = {"v41": ("v41", "fp4"), "fp8": ("fp8", "fp4"), "bf16": ("bf16", "bf16")}[a.kv_format]
    if a.speculative:
        eng.spec_graphs = SpeculativeGraphs(eng.model, eng.store, eng.drafter.cache, eng.store.new_seq().slot,
                                            capture=False)
    else:
        eng.graphs = DecodeGraphs(eng.model, eng.store, capture=False)
    g = torch.Generator().manual_seed(0)
    seq = eng.add_request(torch.randint(2, eng.config.vocab_size, (a.context,), generator=g).tolist(),
                          SamplingParams(max_tokens=16, ignore_eos=True))
    while seq.first_token_time is None:
        if not eng.step() and seq.error is not None:
            raise SystemExit(f"the request failed: {seq.error}")
    for _ in range(3):          # past the first decode steps (graph buckets, state set-up)
        eng.step()
    census = LaunchCensus()
    census.count_triton()
    counter = "spec_graph_steps" if a.speculative else "graph_steps"
    before = getattr(eng.stats, counter)
    with census:
        census.on = True
        eng.step()
        census.on = False
    assert getattr(eng.stats, counter) == before + 1, "the counted step did not take the graphs' forward"
    layers = eng.config.num_hidden_layers
    total = sum(census.sites.values())
    what = f"speculative step (k = {a.speculative})" if a.speculative else "decode step"
    print(f"# {Path(a.model).name}, kv {a.kv_format}: {total} launches in one {what}, {layers} layers "
          f"({total / layers:.1f} a layer)")
    for site, n in census.sites.most_common(a.top):
        print(f"{n:6d}  {site}")
    if a.ops:
        print("\n(site, operator) pairs:")
        for (site, op), n in census.ops.most_common(a.ops):
            print(f"{n:6d}  {op:28s} {site}")


if __name__ == "__main__":
    main()
