"""Where the engine's prefill of one long prompt goes, on the CPU or a GPU: wall time and tokens/s
of a cold prefill (after a warm-up prefill that compiles the kernels for the chunk shapes), then
the operators that took the most device time (CUDA) or CPU time under `torch.profiler`, and the
number of host-device synchronisations the profiler saw.

    python benchmarks/prefill_profile.py --model DIR [--tokens 16k] [--device cuda] [--kv-format fp8]
        [--dtype bfloat16] [--chunk 2048] [--prefix-caching] [--top 25] [--trace OUT.json]
"""

from __future__ import annotations

import argparse
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


def prefill(llm: LLM, prompt: list[int], device: str) -> float:
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, ignore_eos=True))[0]
    if out.error:
        raise RuntimeError(out.error)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--tokens", type=_parse_count, default=16384)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--kv-format", default="native", choices=["native", "bf16", "fp8", "v41"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's compute dtype")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per engine step")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="prefix caching on (full window policy: a state snapshot at every block boundary)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    a = ap.parse_args()
    llm = LLM(a.model, device=a.device, dtype=getattr(torch, a.dtype), num_blocks=a.tokens // 128 + 8, max_num_seqs=1,
              max_model_len=a.tokens + 64, kv_format=a.kv_format, max_num_batched_tokens=a.chunk,
              enable_prefix_caching=a.prefix_caching)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, llm.config.vocab_size, (a.tokens,), generator=g).tolist()
    warm = prefill(llm, prompt[:min(a.tokens, 2 * a.chunk)], a.device)
    cold = prefill(llm, prompt, a.device)
    print(f"# {Path(a.model).name}, {a.tokens} tokens, chunk {a.chunk}, kv {a.kv_format}, {a.dtype}, "
          f"prefix caching {'on' if a.prefix_caching else 'off'}, device {a.device} "
          f"({torch.cuda.get_device_name() if a.device.startswith('cuda') else 'CPU'}), torch {torch.__version__}")
    print(f"warm-up prefill of {min(a.tokens, 2 * a.chunk)} tokens: {warm:.2f} s; "
          f"prefill of {a.tokens}: {cold:.2f} s = {a.tokens / cold:,.0f} tok/s")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        profiled = prefill(llm, prompt, a.device)
    print(f"prefill under the profiler: {profiled:.2f} s")
    events = prof.key_averages()
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                     "cudaMemcpyAsync", "cudaMemcpy"))
    if a.device.startswith("cuda"):
        # kernel rows only: an operator row's own device time repeats the kernels it launched
        busy = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e6
        print(f"device busy {busy:.2f} s of {profiled:.2f} s; {syncs} memcpy/synchronize calls")
    key = "self_device_time_total" if a.device.startswith("cuda") else "self_cpu_time_total"
    print(events.table(sort_by=key, row_limit=a.top))
    if a.trace:
        prof.export_chrome_trace(a.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
