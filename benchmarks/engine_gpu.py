"""The GPU serving path at V4-Flash's real MoE width, against the bytes a decode step must read.

Builds (once, reused) a random V4-Flash-shaped checkpoint of `--layers` blocks at the real MoE
width (256 experts × 2048, FP4 experts, FP8 linears; `hybridkv.tools.random_checkpoint`), serves it
with fp8 KV, and for each weight path (`packed`: the kernels that read FP8/FP4 weights; `dense`:
HYBRIDKV_DENSE_WEIGHTS=1, the dequantised copies of before) measures in a fresh process:

- decode at each batch × context (and 1M at B=1 with --million): wall ms per step (host clock
  over --steps steps run back to back, the device synchronised before and after them, so that a
  step queued by async scheduling overlaps the host's work as in serving), device ms per step
  (kernel time under torch.profiler), tokens/s,
  the elapsed device time of the last step's graph replayed back to back between device events
  (`replay ms`: its kernels and the gaps between them), and the least bytes the step must read:
  the non-expert weights of the blocks and the head, the routed experts the step's tokens selected
  (counted in an extra eager step with hooks on the gates), the KV the attention kernels must read
  (each layer's window, a CSA layer's top-k entries and every indexer key, an HCA layer's
  entries). `bytes ms` = those bytes ÷ --bandwidth (the H200's measured copy rate, 4.13 TB/s),
  `ratio` = device ms ÷ bytes ms, `replay/bytes` = replay ms ÷ bytes ms. With programmatic
  dependent launch (on by default on Hopper: `hybridkv.ops.pdl`) a kernel's profiled time includes
  its wait for the previous one, so the summed device ms overlap and the replay is the step's
  device time; `HYBRIDKV_PDL=0` measures without it.
- GPU memory after loading and the peak over the run, next to the checkpoint's bytes and the KV
  pool's; and by phase (`benchmarks/memory_phases.py`: loading, the warm-up, each prefill, each
  cell's fill, decode and eager counting step), with `--memory-trace PHASES` the tensors live at
  those phases' peaks, summed by the line of hybridkv that allocated them.
- `--fill fork`: each decode cell prefills one request and forks it into the batch (`EngineCore.fork`:
  copies of its cache, so the pool's bytes and the attention's reads are those of distinct
  requests), all sampling at temperature 1 so that their rows part from the first decode step; the
  experts a step selects are counted as always. A B=64 cell at 128K then prefills 128K tokens
  instead of 8M: for its decode step and decode memory when the device time is short. Its fill
  peaks as one prefill does, not as prefill chunks beside other requests' decode rows (which
  `prefill`, the default, runs: every request's own random prompt, greedy).
- prefill tokens/s of one request at each --prefill length, and the TFLOP/s of the linear layers
  (their FLOPs ÷ the device time of the GEMM kernels in a profiled prefill); with
  `--prefill-cprofile N` a third run under cProfile prints the host's N costliest functions.
- `--paths mtp`: the packed path with MTP speculative decoding (`--num-speculative-tokens K`, 1 by
  default): each decode cell's wall, device and replay ms of one speculative step (verify, rollback
  and drafting replayed as one graph: engine/spec_graphs.py) and its tokens per step. A random
  checkpoint's MTP block drafts tokens the model rejects, so these rows give what a step costs
  against `packed`'s plain step, not what speculation gains; their byte columns are left empty.
- `--paths hf`: the same cells through HF transformers' `DeepseekV4ForCausalLM` on the same
  checkpoint (bf16, its own cache); an import, load, out-of-memory or run failure is a row saying
  why. `--dense-layers N` serves the dense and hf paths on the first N blocks (their bf16 expert
  copies do not fit 8 blocks), `--first-layers N` every path.

    python benchmarks/engine_gpu.py --ckpt /tmp/v4flash-8 [--layers 8] [--batches 1,8,64]
        [--contexts 4k,128k] [--million] [--prefill 16k,128k] [--paths packed,dense,mtp,hf] [--steps 16]
        [--num-speculative-tokens K] [--prefill-cprofile N] [--first-layers N] [--dense-layers N]
        [--memory-trace 'fill:*,decode:*'] [--json OUT]
    python benchmarks/engine_gpu.py --smoke       # a tiny model on the CPU: checks the script runs

Filling 64 requests of 128K takes 8M prefill tokens; `--paths packed --batches 64 --contexts 128k`
runs that cell alone. CPU numbers (--smoke) are not results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.cache.layout import entry_bytes  # noqa: E402
from hybridkv.cli import _parse_count  # noqa: E402
from hybridkv.weights import INDEX_FILE  # noqa: E402
from decode_context import replay_ms, sync, timed_steps  # noqa: E402  (this folder is on sys.path)
from memory_phases import MemoryPhases  # noqa: E402

# the linear layers' kernels (widen: prefill's FP4 experts widened for the grouped GEMM, their cost)
GEMM_KERNELS = re.compile(r"gemm|matmul|linear_mma|grouped_fp4|widen|cutlass|xmma|gemv|splitk|cublas|sm90_|nvjet", re.I)
# operator families of a step's kernels, first match wins (kernel names: Triton's function names,
# torch's ATen kernel names, cuBLAS' nvjet/sm90 names)
FAMILIES = [
    ("communication (NCCL)", re.compile(r"nccl", re.I)),      # several GPUs: the collectives
    ("linear (GEMM)", GEMM_KERNELS),
    ("MoE routing / combine", re.compile(r"moe_combine|route_kernel", re.I)),
    ("attention", re.compile(r"sparse_attn|combine_kernel|score_decode|score_tile|indexer|attn|flash", re.I)),
    ("compressor", re.compile(r"compress", re.I)),
    ("mHC / norms", re.compile(r"pre_kernel|post_kernel|sinkhorn|rms|norm|mhc", re.I)),
    ("quantise", re.compile(r"act_quant|fp8_round_trip|quant|e4m3|e8m0", re.I)),
    ("routing / sort", re.compile(r"sort|radix|topk|scatter|gather|index|histogram|cumsum|scan|bincount", re.I)),
    ("reductions", re.compile(r"reduce", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|cat|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi", re.I)),
]
WARM_STEPS = 3


# ----- counting -----------------------------------------------------------------------------------

def _tensor_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def weight_bytes(model) -> dict[str, int]:
    """Bytes a decode step reads whatever the routing: the blocks without their routed experts, the
    head, the final norm and hc head; and one routed expert's bytes (w1 + w3 + w2 with scales)."""
    blocks = 0
    for layer in model.layers:
        blocks += _tensor_bytes(layer) - sum(_tensor_bytes(e) for e in layer.ffn.experts)
        blocks -= sum(b.numel() * b.element_size() for n, b in layer.named_buffers() if n.endswith("tid2eid"))
    head = _tensor_bytes(model.head) + _tensor_bytes(model.norm)
    head += sum(p.numel() * p.element_size() for n, p in model.named_parameters(recurse=False))
    mtp = sum(_tensor_bytes(m) - sum(_tensor_bytes(e) for e in m.ffn.experts) for m in model.mtp) \
        if getattr(model, "mtp", None) else 0
    return {"non_expert": blocks + head, "expert": _tensor_bytes(model.layers[0].ffn.experts[0]),
            "head": _tensor_bytes(model.head), "mtp_non_expert": mtp}


def kv_read_bytes(config, context: int, topk: int) -> int:
    """KV bytes the attention kernels read for one request decoding at `context` (fp8 layout)."""
    eb = entry_bytes(config, "fp8")
    total = 0
    for r in config.compress_ratios[: config.num_hidden_layers]:
        total += min(context, config.sliding_window) * eb.window
        if r == 4:
            total += min(topk, context // 4) * eb.main + (context // 4) * eb.index
        elif r:
            total += (context // r) * eb.main
    return total


def linear_flops_per_token(model) -> int:
    """2·in·out of every linear layer a prefill token passes through (routed experts: k of them;
    the LM head runs for the last token only and is left out)."""
    from hybridkv.model.linear import Linear
    cfg = model.config
    flops = 0
    for layer in model.layers:
        for name, m in layer.named_modules():
            if ".experts." in f".{name}" or name.startswith("ffn.experts"):
                continue
            if isinstance(m, (Linear, torch.nn.Linear)):
                flops += 2 * m.in_features * m.out_features
        flops += 2 * layer.ffn.gate.weight.numel()
        e = layer.ffn.experts[0]
        flops += cfg.num_experts_per_tok * 2 * sum(lin.in_features * lin.out_features for lin in (e.w1, e.w2, e.w3))
    return flops


class ExpertCounter:
    """Distinct routed experts selected per layer while attached (hooks on the gates of `layers`,
    default the model's layers)."""

    def __init__(self, model, layers=None):
        layers = list(model.layers if layers is None else layers)
        self.per_layer: list[set[int]] = [set() for _ in layers]
        self.handles = [layer.ffn.gate.register_forward_hook(self._hook(i)) for i, layer in enumerate(layers)]

    def _hook(self, i):
        def hook(_mod, _inp, out):
            self.per_layer[i].update(out[1].flatten().tolist())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    @property
    def total(self) -> int:
        return sum(len(s) for s in self.per_layer)


# ----- timing -------------------------------------------------------------------------------------

def family(kernel: str) -> str:
    return next((name for name, pattern in FAMILIES if pattern.search(kernel)), "other")


def device_ms(fn, cuda: bool) -> tuple[float | None, float | None, list[tuple[str, float, int]], dict[str, float]]:
    """(all kernels' device ms, GEMM kernels' device ms, every kernel as [name, ms, launches] by
    time, ms by operator family) of fn() under the profiler."""
    if not cuda:
        fn()
        return None, None, [], {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 1e3
    gemm = sum(e.self_device_time_total for e in kernels if GEMM_KERNELS.search(e.key)) / 1e3
    top = sorted(((e.key[:80], e.self_device_time_total / 1e3, e.count) for e in kernels), key=lambda kv: -kv[1])
    families: dict[str, float] = {}
    for e in kernels:
        families[family(e.key)] = families.get(family(e.key), 0.0) + e.self_device_time_total / 1e3
    return busy, gemm, top, dict(sorted(families.items(), key=lambda kv: -kv[1]))


# ----- the worker (one weight path, one process) ----------------------------------------------------

def workload(a) -> tuple[list[tuple[int, int]], list[int]]:
    """The decode cells (batch, context) within --max-tokens (the others named as left out) and the
    prefill lengths the options ask for."""
    batches = [int(b) for b in a.batches.split(",") if b]          # "": prefill only
    contexts = [_parse_count(c) for c in a.contexts.split(",") if c]
    cells = [(b, c) for b in batches for c in contexts] + ([(1, 1 << 20)] if a.million else [])
    if a.max_tokens:
        for b, c in cells:
            if b * c > a.max_tokens:
                print(f"# B={b} x {c:,} left out: {b * c:,} context tokens > --max-tokens", flush=True)
        cells = [(b, c) for b, c in cells if b * c <= a.max_tokens]
    prefills = [_parse_count(c) for c in a.prefill.split(",")] if a.prefill else []
    return cells, prefills


def decode_budget(a, b: int, ctx: int) -> int:
    """Tokens each request of a (batch, context) cell may generate: the measured steps, and the
    steps in which a request whose prompt is done decodes while the rest of the batch prefills (a
    step schedules decode first; ⌈b · ctx / chunk⌉ of them). The pool holds every request's
    blocks for that many tokens (`pool_blocks`): one sized from the batch's total tokens was a few
    blocks short (each request rounds up to whole blocks), so B=64 cells preempted requests, whose
    prompts were computed again while the others decoded to their end. A cell reports its prefill
    steps and fails if a request ends or is preempted before it is measured."""
    return WARM_STEPS + 2 * a.steps + 8 + -(-b * ctx // a.chunk) + 1


def pool_blocks(a, cells: list[tuple[int, int]], prefills: list[int], block_tokens: int = 128) -> int:
    """KV blocks for the largest cell: each request's prompt and decode budget in whole blocks."""
    need = [b * -(-(c + decode_budget(a, b, c)) // block_tokens) for b, c in cells]
    return max(need + [-(-(p + 256) // block_tokens) for p in prefills]) + 16


def worker(a) -> None:
    from hybridkv.engine import LLM, SamplingParams
    cuda = a.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    cells, prefills = workload(a)
    base = torch.cuda.memory_allocated() if cuda else 0
    phases = MemoryPhases(base, trace=a.memory_trace, enabled=cuda)      # each phase resets the peak
    spec = a.path == "mtp"
    with phases("load"):
        llm = LLM(a.ckpt, device=a.device, dtype=dtype, kv_format="fp8", num_blocks=pool_blocks(a, cells, prefills),
                  max_num_seqs=max([b for b, _ in cells] + [1]), max_num_batched_tokens=a.chunk,
                  enable_prefix_caching=False, async_scheduling=a.async_scheduling,
                  **(dict(speculative="mtp", num_speculative_tokens=a.num_speculative_tokens) if spec else {}))
    eng, model, cfg = llm.engine, llm.engine.model, llm.engine.model.config
    from hybridkv.ops import pdl
    pdl_on = pdl.enabled(torch.empty(0, device=a.device))
    loaded = torch.cuda.memory_allocated() - base if cuda else None
    wb = weight_bytes(model)
    pool = sum(eng.store.nbytes_by_kind().values())
    ckpt = json.loads((Path(a.ckpt) / INDEX_FILE).read_text())["metadata"]["total_size"]
    kernels = {}
    if cuda and a.path == "packed" and os.environ.get("HYBRIDKV_GROUPED_FP4") != "0":
        from hybridkv.ops.qgemm import scaled
        from hybridkv.ops.qgemm import triton as qk
        dev = torch.device(a.device)
        kernels = dict(fp4_dot=qk.fp4_dot_report(dev), scaled_mm=scaled.layout(dev)[1])
        print(f"# grouped FP4 MMA: {kernels['fp4_dot']}; scaled_mm: {kernels['scaled_mm']}", flush=True)
    emit(dict(kind="memory", path=a.path, layers=cfg.num_hidden_layers, kernels=kernels, checkpoint_bytes=ckpt,
              kv_pool_bytes=pool, after_load_bytes=loaded,
              non_expert_bytes=wb["non_expert"], expert_bytes=wb["expert"]))
    g = torch.Generator().manual_seed(0)

    def prompt(n):
        return torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()

    flops_tok = linear_flops_per_token(model)
    if prefills:                       # one chunk first: Triton compiles the prefill shapes outside the timing
        with phases("warmup"):
            warm = eng.add_request(prompt(a.chunk), SamplingParams(max_tokens=1, ignore_eos=True))
            while warm.first_token_time is None:
                eng.step()
            eng.abort(warm.request_id)
    def prefill(ids):
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, ignore_eos=True))
        while seq.first_token_time is None:
            eng.step()
        eng.abort(seq.request_id)

    for n in prefills:
        # device time from a first run under the profiler, which also compiles the kernel variants
        # of this length's chunks (a 128K prompt's later chunks see more entries than the warm-up's);
        # wall time from a second run without it (the profiler adds tens of microseconds to every
        # launch it records)
        ids = prompt(n)
        with phases(f"prefill:{n}"):
            busy, gemm, top, _ = device_ms(lambda: prefill(ids), cuda)
            t = time.perf_counter()
            prefill(ids)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        if a.prefill_cprofile:      # a third run: where the host spends a prefill's time
            import cProfile
            import pstats
            hot = cProfile.Profile()
            hot.runcall(prefill, ids)
            print(f"# prefill {n:,}: host time under cProfile", flush=True)
            for order in ("tottime", "cumulative"):
                pstats.Stats(hot, stream=sys.stdout).sort_stats(order).print_stats(a.prefill_cprofile)
        emit(dict(kind="prefill", path=a.path, tokens=n, wall_s=wall, tok_s=n / wall, device_ms=busy, gemm_ms=gemm,
                  linear_tflops=flops_tok * n / (gemm * 1e-3) / 1e12 if gemm else None, top=top))
    for b, ctx in cells:
        budget = decode_budget(a, b, ctx) * ((a.num_speculative_tokens + 1) if spec else 1)
        ctx = min(ctx, eng.max_model_len - budget)
        fork = a.fill == "fork" and b > 1
        params = SamplingParams(max_tokens=budget, ignore_eos=True, **(dict(temperature=1.0) if fork else {}))
        seqs = [eng.add_request(prompt(ctx), params) for _ in range(1 if fork else b)]
        prefill_steps, preempted = 0, eng.scheduler.num_preemptions
        with phases(f"fill:{b}x{ctx}"):
            while any(s.first_token_time is None for s in seqs):
                eng.step()
                prefill_steps += 1
            if fork:
                seqs += eng.fork(seqs[0].request_id, b - 1, params)
        with phases(f"decode:{b}x{ctx}"):
            timed_steps(eng, WARM_STEPS, a.device)
            produced = sum(len(s.output_ids) for s in seqs)
            wall = steps_back_to_back(eng, a.steps, a.device) / a.steps
            per_step = (sum(len(s.output_ids) for s in seqs) - produced) / a.steps       # tokens a step emits
            busy, _, top, fams = device_ms(lambda: steps_back_to_back(eng, a.steps, a.device), cuda)
            replay = replay_ms(eng) if cuda else None     # the last step's graph, between device events
        ended = sum(s.finish_reason is not None for s in seqs)
        preempted = eng.scheduler.num_preemptions - preempted
        if ended or preempted:
            raise RuntimeError(f"B={b} x {ctx:,}: {ended} requests ended and {preempted} were preempted before the "
                               f"measurement ended (decode_budget; the prefill took {prefill_steps} steps, outputs "
                               f"{sorted(len(s.output_ids) for s in seqs)[-4:]} at most)")
        dev = busy / a.steps if busy is not None else None
        row = dict(kind="decode", path=a.path, batch=b, context=ctx, prefill_steps=prefill_steps,
                   wall_ms=1e3 * wall, tok_s=per_step / wall, tokens_per_step=per_step, device_ms=dev,
                   replay_ms=replay, pdl=pdl_on, wall_over_device=1e3 * wall / dev if dev else None, top=top,
                   families={k: v / a.steps for k, v in fams.items()})
        if spec:     # a random MTP block's steps: what they cost, and the least bytes they must read
            row["graph_steps"] = eng.stats.spec_graph_steps
            graphs, eng.spec_graphs = eng.spec_graphs, None    # one eager step with hooks on the gates
            with phases(f"count:{b}x{ctx}"):
                timed_steps(eng, 1, a.device)
                main, mtp = ExpertCounter(model), ExpertCounter(model, model.mtp)
                timed_steps(eng, 1, a.device)
                main.close()
                mtp.close()
            eng.spec_graphs = graphs
            k = a.num_speculative_tokens
            # the verify rows read the model, its head and the experts they select, each their KV; the
            # MTP block reads itself, its experts and the head once per draft
            must = (wb["non_expert"] + main.total * wb["expert"] + wb["mtp_non_expert"] + mtp.total * wb["expert"]
                    + k * wb["head"] + (k + 1) * b * kv_read_bytes(cfg, ctx, cfg.index_topk))
            bytes_ms = must / a.bandwidth * 1e3
            row.update(must_read_bytes=must, experts_selected=main.total + mtp.total, bytes_ms=bytes_ms,
                       ratio=dev / bytes_ms if dev is not None else None,
                       replay_ratio=replay / bytes_ms if replay is not None else None)
        else:
            graphs, eng.graphs = eng.graphs, None            # one eager step with hooks on the gates
            with phases(f"count:{b}x{ctx}"):
                timed_steps(eng, 1, a.device)                # (after settling a step async scheduling queued)
                counter = ExpertCounter(model)
                timed_steps(eng, 1, a.device)
                counter.close()
            eng.graphs = graphs
            must = wb["non_expert"] + counter.total * wb["expert"] + b * kv_read_bytes(cfg, ctx, cfg.index_topk)
            bytes_ms = must / a.bandwidth * 1e3
            row.update(must_read_bytes=must, experts_selected=counter.total, bytes_ms=bytes_ms,
                       ratio=dev / bytes_ms if dev is not None else None,
                       replay_ratio=replay / bytes_ms if replay is not None else None)
        emit(row)
        for s in seqs:
            eng.abort(s.request_id)
    if cuda:
        for r in phases.rows:
            emit(dict(kind="memory_phase", path=a.path, **r))
        emit(dict(kind="peak", path=a.path, peak_bytes=phases.peak, reserved_bytes=torch.cuda.memory_reserved()))


def steps_back_to_back(eng, steps: int, device: str) -> float:
    """Seconds for `steps` engine steps with no wait for the device between them (it is synchronised
    before and after): what a serving loop sees, the host's work overlapping the device's where the
    engine queues the next step (async scheduling)."""
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(device)
    return time.perf_counter() - t


def hf_worker(a) -> None:
    """The same cells through HF transformers' `DeepseekV4ForCausalLM` on the same checkpoint
    (bf16 on CUDA, its own KV cache, greedy): memory after loading, prefill, decode wall and
    device time. First as the checkpoint says (its FP8 linears on transformers' FP8 kernels); where
    that cannot load or run, a row says why and the weights are dequantised to bf16 at load instead
    (`FineGrainedFP8Config(dequantize=True)`), the rows then under path `hf-bf16`. What fails (the
    import, the load, a cell out of memory) is a row saying why."""
    cuda = a.device.startswith("cuda")
    # transformers would fetch activation kernels from the Hub at load time; the baseline is its own
    # PyTorch code, which also loads on a host without network access (USE_HUB_KERNELS=YES: the Hub's)
    os.environ.setdefault("USE_HUB_KERNELS", "NO")
    try:
        import transformers
        cls = transformers.DeepseekV4ForCausalLM
    except (ImportError, AttributeError) as e:
        emit(dict(kind="unavailable", path="hf", why=f"{type(e).__name__}: {e}"))
        return
    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if cuda else torch.float32
    quant = json.loads((Path(a.ckpt) / "config.json").read_text()).get("quantization_config")
    model = None
    for label in ("hf", "hf-bf16"):
        if label == "hf-bf16" and not quant:
            return
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        extra = ({"quantization_config": transformers.FineGrainedFP8Config.from_dict({**quant, "dequantize": True})}
                 if label == "hf-bf16" else {})
        try:
            model = cls.from_pretrained(a.ckpt, dtype=dtype, device_map=a.device, **extra).eval()
            with torch.inference_mode():          # one short forward: what cannot run fails here
                model(torch.randint(2, model.config.vocab_size, (1, 16), device=a.device), use_cache=False)
            break
        except Exception as e:  # what this transformers cannot load or run is the finding
            emit(dict(kind="unavailable", path=label, why=f"transformers {transformers.__version__}: {_failure(e)}"))
            model = None
    if model is None:
        return
    ckpt = json.loads((Path(a.ckpt) / INDEX_FILE).read_text())["metadata"]["total_size"]
    emit(dict(kind="memory", path=label, layers=model.config.num_hidden_layers, kernels={"transformers":
              transformers.__version__}, checkpoint_bytes=ckpt, kv_pool_bytes=0,
              after_load_bytes=torch.cuda.memory_allocated() - base if cuda else None))
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size

    def ids(b, n):
        return torch.randint(2, vocab, (b, n), generator=g).to(a.device)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cells, prefills = workload(a)
    with torch.inference_mode():
        for n in prefills:
            x = ids(1, n)
            try:
                t = time.perf_counter()
                model(x, use_cache=False)
                sync()
                wall = time.perf_counter() - t
                busy, gemm, top, _ = device_ms(lambda: model(x, use_cache=False), cuda)
            except Exception as e:     # out of memory, or what this transformers cannot run: the finding
                emit(dict(kind="unavailable", path=label, why=f"prefill {n}: {_failure(e)}"))
                continue
            emit(dict(kind="prefill", path=label, tokens=n, wall_s=wall, tok_s=n / wall, device_ms=busy,
                      gemm_ms=gemm, linear_tflops=None, top=top))
        for b, ctx in cells:
            try:
                out = model(ids(b, ctx), use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)

                def steps(k):
                    nonlocal cache, nxt
                    times = []
                    for _ in range(k):
                        t = time.perf_counter()
                        out = model(nxt, past_key_values=cache, use_cache=True)
                        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
                        sync()
                        times.append(time.perf_counter() - t)
                    return times
                steps(WARM_STEPS)
                wall = statistics.median(steps(a.steps))
                busy, _, top, fams = device_ms(lambda: steps(a.steps), cuda)
            except Exception as e:
                emit(dict(kind="unavailable", path=label, why=f"B={b} x {ctx}: {_failure(e)}"))
                cache = out = None
                continue
            dev = busy / a.steps if busy is not None else None
            emit(dict(kind="decode", path=label, batch=b, context=ctx, wall_ms=1e3 * wall, tok_s=b / wall,
                      device_ms=dev, must_read_bytes=None, experts_selected=None, bytes_ms=None, ratio=None,
                      wall_over_device=1e3 * wall / dev if dev else None, top=top,
                      families={k: v / a.steps for k, v in fams.items()}))
            del cache, out
    if cuda:
        emit(dict(kind="peak", path=label, peak_bytes=torch.cuda.max_memory_allocated() - base,
                  reserved_bytes=torch.cuda.memory_reserved()))


def _failure(e: Exception) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory ({str(e)[:120]})"
    return f"{type(e).__name__}: {str(e)[:300]}"


def emit(row: dict) -> None:
    print("ROW " + json.dumps(row), flush=True)


# ----- the driver ---------------------------------------------------------------------------------

def ensure_checkpoint(a) -> None:
    if (Path(a.ckpt) / INDEX_FILE).exists():
        return
    from hybridkv.tools.random_checkpoint import shaped_config, write_random_checkpoint
    cfg = (shaped_config("v4-tiny-fp8", layers=a.layers) if a.smoke
           else shaped_config("v4-flash", layers=a.layers))
    t = time.perf_counter()
    write_random_checkpoint(cfg, a.ckpt, jobs=min(os.cpu_count() or 1, 10))
    print(f"# wrote {a.ckpt} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts x "
          f"{cfg.moe_intermediate_size}) in {time.perf_counter() - t:.0f} s", flush=True)


def first_layers_view(ckpt: str, n: int) -> str:
    """A checkpoint directory that serves the first `n` blocks of `ckpt` (with its embedding, MTP
    block(s) and head): a config and index of their own, links to the same shards. The dense path's
    bf16 expert copies do not fit an H200 at 8 blocks of real MoE width; this measures it on fewer."""
    src = Path(ckpt)
    cfg = json.loads((src / "config.json").read_text())
    main = cfg["num_hidden_layers"]
    if n >= main:
        return ckpt
    view = src.parent / f"{src.name}-first{n}"
    view.mkdir(exist_ok=True)
    index = json.loads((src / INDEX_FILE).read_text())
    keep = {k: f for k, f in index["weight_map"].items()
            if not (m := re.match(r"layers\.(\d+)\.", k)) or int(m.group(1)) < n}
    for f in set(keep.values()):
        if not (view / f).exists():
            (view / f).symlink_to(src.resolve() / f)
    ratios = cfg["compress_ratios"]
    cfg.update(num_hidden_layers=n, compress_ratios=ratios[:n] + ratios[main:],
               num_hash_layers=min(cfg.get("num_hash_layers", 0), n))
    (view / "config.json").write_text(json.dumps(cfg, indent=2))
    size = 0
    for f in set(keep.values()):
        with open(view / f, "rb") as h:                    # a safetensors header: length, then JSON
            header = json.loads(h.read(int.from_bytes(h.read(8), "little")))
        size += sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items() if k in keep)
    (view / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": size}, "weight_map": keep}, indent=2))
    return str(view)


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def fmt(x, spec=".2f") -> str:
    return "—" if x is None else format(x, spec)


def report(rows: list[dict], a) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke: not a result)"
    print(f"\n# {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {dev}, torch {torch.__version__}; "
          f"command: python benchmarks/engine_gpu.py {' '.join(sys.argv[1:])}")
    print("\n| path | batch | context | tok/s | wall ms | device ms | replay ms | wall/device | must read | bytes ms | "
          "device/bytes | replay/bytes | experts |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "decode" and r["path"] != "mtp":
            print(f"| {r['path']} | {r['batch']} | {r['context']:,} | {r['tok_s']:.1f} | {r['wall_ms']:.2f} | "
                  f"{fmt(r['device_ms'])} | {fmt(r.get('replay_ms'))} | {fmt(r['wall_over_device'])} | {fmt_bytes(r['must_read_bytes'])} | "
                  f"{fmt(r['bytes_ms'], '.3f')} | {fmt(r['ratio'])} | {fmt(r.get('replay_ratio'))} | "
                  f"{fmt(r['experts_selected'], 'd')} |")
    spec = [r for r in rows if r["kind"] == "decode" and r["path"] == "mtp"]
    if spec:
        plain = {(r["batch"], r["context"]): r.get("replay_ms") for r in rows
                 if r["kind"] == "decode" and r["path"] == "packed"}
        print(f"\nMTP speculation, k = {a.num_speculative_tokens} (the random MTP block's drafts are rejected: "
              f"what a step costs, not what it gains):\n")
        plain_bytes = {(r["batch"], r["context"]): r.get("must_read_bytes") for r in rows
                       if r["kind"] == "decode" and r["path"] == "packed"}
        print("| batch | context | tokens/step | tok/s | wall ms | device ms | replay ms | replay ÷ packed replay | "
              "must read | replay/bytes | must read ÷ packed's |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in spec:
            base = plain.get((r["batch"], r["context"]))
            ratio = r["replay_ms"] / base if base and r.get("replay_ms") else None
            pb = plain_bytes.get((r["batch"], r["context"]))
            print(f"| {r['batch']} | {r['context']:,} | {r['tokens_per_step']:.2f} | {r['tok_s']:.1f} | "
                  f"{r['wall_ms']:.2f} | {fmt(r['device_ms'])} | {fmt(r.get('replay_ms'))} | {fmt(ratio)} | "
                  f"{fmt_bytes(r.get('must_read_bytes'))} | {fmt(r.get('replay_ratio'))} | "
                  f"{fmt(r['must_read_bytes'] / pb if pb and r.get('must_read_bytes') else None)} |")
        print("\nA step that accepts L tokens on average decodes L ÷ (replay ÷ packed replay) times as fast as "
              "plain decoding; at the byte limit, at most L ÷ (must read ÷ packed's).")
    print("\nDevice ms of one decode step by operator family:\n")
    for r in rows:
        if r["kind"] == "decode" and r.get("families"):
            parts = ", ".join(f"{k} {v:.3f}" for k, v in r["families"].items())
            print(f"- {r['path']} B={r['batch']} ctx={r['context']:,}: {parts}")
    print("\n| path | prefill tokens | tok/s | device ms | GEMM ms | linear TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "prefill":
            print(f"| {r['path']} | {r['tokens']:,} | {r['tok_s']:.0f} | {fmt(r['device_ms'], '.1f')} | "
                  f"{fmt(r['gemm_ms'], '.1f')} | {fmt(r['linear_tflops'], '.0f')} |")
    for r in rows:
        if r["kind"] == "unavailable":
            print(f"- {r['path']}: {r['why']}")
    phase_rows = [r for r in rows if r["kind"] == "memory_phase"]
    if phase_rows:
        print("\nGPU memory by phase, above the memory before loading (start, the phase's peak, end):\n")
        print("| path | phase | start | peak | end |")
        print("|---|---|---|---|---|")
        for r in phase_rows:
            print(f"| {r['path']} | {r['phase']} | {fmt_bytes(r['start_bytes'])} | {fmt_bytes(r['peak_bytes'])} | "
                  f"{fmt_bytes(r['end_bytes'])} |")
        for r in phase_rows:
            if r.get("top"):
                print(f"\n{r['path']} {r['phase']}: live at its peak, allocated within it ({r['trace_events']:,} "
                      "allocator events):")
                for where, n in r["top"]:
                    print(f"  {fmt_bytes(n):>10}  {where}")
    print("\n| path | blocks | checkpoint | KV pool | after load | peak | peak − (checkpoint + pool) |")
    print("|---|---|---|---|---|---|---|")
    for path in dict.fromkeys(r["path"] for r in rows):
        mem = next((r for r in rows if r["kind"] == "memory" and r["path"] == path), None)
        peak = next((r for r in rows if r["kind"] == "peak" and r["path"] == path), None)
        if mem:
            over = peak["peak_bytes"] - mem["checkpoint_bytes"] - mem["kv_pool_bytes"] if peak else None
            print(f"| {path} | {mem['layers']} | {fmt_bytes(mem['checkpoint_bytes'])} | {fmt_bytes(mem['kv_pool_bytes'])} | "
                  f"{fmt_bytes(mem['after_load_bytes'])} | {fmt_bytes(peak and peak['peak_bytes'])} | "
                  f"{fmt_bytes(over)} |")


def collect_rows(cmd: list[str], env: dict, rows: list[dict], json_path: str | None, on_row=None) -> int:
    """Run a worker process, echoing its output and appending its `ROW` lines to `rows` (each
    passed to `on_row` first; the json file rewritten after every row, so that a run stopped early
    keeps what it measured). Returns the worker's exit code."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            if on_row is not None:
                on_row(row)
            rows.append(row)
            print(json.dumps(row)[:400], flush=True)
            if json_path:
                Path(json_path).write_text(json.dumps(rows, indent=1))
        else:
            print(line, end="", flush=True)
    return proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=None, help="checkpoint directory (written there if missing)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4k,128k")
    ap.add_argument("--million", action="store_true", help="also decode at 1M tokens with batch 1")
    ap.add_argument("--prefill", default="16k,128k")
    ap.add_argument("--paths", default="packed,dense", help="packed, dense (HYBRIDKV_DENSE_WEIGHTS=1), mtp (packed "
                    "with MTP speculation) and/or hf (HF transformers' DeepseekV4ForCausalLM)")
    ap.add_argument("--num-speculative-tokens", type=int, default=1, help="draft tokens of the mtp path")
    ap.add_argument("--dense-experts", action="store_true",
                    help="packed path: FP4 experts from dense bf16 copies instead of the grouped FP4 kernels "
                         "(HYBRIDKV_GROUPED_FP4=0)")
    ap.add_argument("--dense-layers", type=int, default=None,
                    help="serve only the first N blocks on the dense and hf paths (bf16 expert copies are 4x the FP4)")
    ap.add_argument("--first-layers", type=int, default=None,
                    help="every path serves only the first N blocks of --ckpt (to set one beside --dense-layers)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--max-tokens", type=_parse_count, default=None,
                    help="leave out the decode cells whose batch x context exceeds this (their prefill is long)")
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per engine step")
    ap.add_argument("--fill", choices=("prefill", "fork"), default="prefill",
                    help="decode cells: prefill each request's prompt, or one request forked into the batch")
    ap.add_argument("--prefill-cprofile", type=int, default=0, metavar="N",
                    help="also run each prefill under cProfile and print its N costliest functions")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="queue the next decode step before the host reads this one's tokens (default: on)")
    ap.add_argument("--memory-trace", type=lambda v: set(v.split(",")), default=set(), metavar="PHASES",
                    help="list the tensors live at the peak of these phases by the line that allocated them "
                         "(load, warmup, prefill:N, fill:BxCTX, decode:BxCTX, count:BxCTX; fnmatch patterns such "
                         "as fill:64x*; slows them)")
    ap.add_argument("--bandwidth", type=float, default=4.13e12, help="bytes/s the byte time is counted at")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU, to check the script")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.smoke:
        a.device, a.layers, a.steps, a.chunk = "cpu", 2, 2, 512
        a.batches, a.contexts, a.prefill = "1,2", "300,600", "600"
        a.ckpt = a.ckpt or str(Path(tempfile.gettempdir()) / "hybridkv-engine-gpu-smoke")
    if a.ckpt is None:
        ap.error("--ckpt DIR is required (the checkpoint is written there once and reused)")
    if a.worker:
        a.path = a.worker
        (hf_worker if a.path == "hf" else worker)(a)
        return 0
    if a.fill == "fork" and "mtp" in a.paths.split(","):
        ap.error("--fill fork: forked requests carry no MTP draft state; run the mtp path with --fill prefill")
    ensure_checkpoint(a)
    rows = []
    for path in a.paths.split(","):
        if path not in ("packed", "dense", "mtp", "hf"):
            ap.error(f"--paths: unknown path {path!r} (packed, dense, mtp, hf)")
        env = {**os.environ, "HYBRIDKV_DENSE_WEIGHTS": "1" if path == "dense" else "0"}
        if path == "packed" and a.dense_experts:
            env["HYBRIDKV_GROUPED_FP4"] = "0"
        cmd = [sys.executable, __file__, "--worker", path] + [x for x in sys.argv[1:]]
        blocks = a.dense_layers if path in ("dense", "hf") and a.dense_layers else a.first_layers
        if blocks:
            cmd += ["--ckpt", first_layers_view(a.ckpt, blocks)]
        code = collect_rows(cmd, env, rows, a.json)
        if code:
            print(f"# the {path} path failed (exit {code}); its rows so far are kept", flush=True)
    report(rows, a)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
