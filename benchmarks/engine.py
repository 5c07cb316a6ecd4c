"""Engine throughput and TTFT on CPU, side by side with HF transformers on the same checkpoint.

    python benchmarks/engine.py [--model tests/fixtures/v4-tiny] [--decode-tokens 32] [--no-hf]

Rows: prefill tokens/s at 2K and 4K (batch 1; TTFT of one request); decode tokens/s at batch 1 and
4 with a 2K context, batch 1 at 4K and 16K. HF transformers (>= 5, `DeepseekV4ForCausalLM`) loads
the same release-format checkpoint; it is timed with its own KV cache (prefill one forward, then
one token per forward). Both run in this process with the same torch thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.engine import LLM, SamplingParams  # noqa: E402

# Wall time by default; --cpu-time uses this process's CPU time instead, which other jobs on a
# shared machine do not inflate (run with OMP_NUM_THREADS=1 so that CPU time equals work).
clock = time.perf_counter


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def ours_prefill(llm: LLM, length: int) -> float:
    p = prompts(1, length, llm.config.vocab_size, seed=length)[0]
    t = clock()
    llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True))
    return length / (clock() - t)


def ours_decode(llm: LLM, batch: int, context: int, n: int) -> float:
    eng = llm.engine
    for p in prompts(batch, context, llm.config.vocab_size, seed=context + batch):
        eng.add_request(p, SamplingParams(max_tokens=n + 1, ignore_eos=True))
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    eng.step()  # every request has its first token: decode from here
    produced, t = 0, clock()
    while eng.has_unfinished():
        produced += len(eng.step())
    return produced / (clock() - t)


def hf_load(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_prefill(model, length: int, vocab: int) -> float:
    ids = torch.tensor(prompts(1, length, vocab, seed=length))
    t = clock()
    model(ids, use_cache=True)
    return length / (clock() - t)


@torch.inference_mode()
def hf_decode(model, batch: int, context: int, n: int, vocab: int) -> float:
    ids = torch.tensor(prompts(batch, context, vocab, seed=context + batch))
    out = model(ids, use_cache=True)
    pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t = clock()
    for _ in range(n):
        out = model(nxt, past_key_values=pkv, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return batch * n / (clock() - t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--cpu-time", action="store_true", help="time with process CPU time instead of wall time")
    a = ap.parse_args()
    global clock
    if a.cpu_time:
        clock = time.process_time
    rows = [("prefill", 1, 2048), ("prefill", 1, 4096), ("decode", 1, 2048), ("decode", 4, 2048),
            ("decode", 1, 4096), ("decode", 1, 16384)]
    print(f"# engine benchmark, {Path(a.model).name}, {date.today()}, {platform.machine()} "
          f"{os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"{'process CPU time' if a.cpu_time else 'wall time'}")
    print(f"# command: python benchmarks/{Path(__file__).name} {' '.join(sys.argv[1:])}")
    hf = None
    if not a.no_hf:
        try:
            import transformers
            hf = hf_load(a.model)
            print(f"# HF transformers {transformers.__version__}")
        except Exception as e:  # report, then carry on with our numbers
            print(f"# HF transformers unavailable: {e}")
    results = []
    print(f"{'phase':<9}{'batch':>6}{'context':>9}{'hybridkv tok/s':>16}{'HF tok/s':>11}{'ratio':>8}")
    for phase, batch, ctx in rows:
        llm = LLM(a.model, num_blocks=(batch * (ctx + a.decode_tokens + 256)) // 128 + 8, max_num_seqs=batch,
                  max_num_batched_tokens=max(ctx, 2048), max_model_len=1 << 16, enable_prefix_caching=False)
        vocab = llm.config.vocab_size
        ours = ours_prefill(llm, ctx) if phase == "prefill" else ours_decode(llm, batch, ctx, a.decode_tokens)
        theirs = None
        if hf is not None and not (phase == "decode" and ctx > 4096):
            theirs = hf_prefill(hf, ctx, vocab) if phase == "prefill" else hf_decode(hf, batch, ctx, a.decode_tokens, vocab)
        results.append({"phase": phase, "batch": batch, "context": ctx, "hybridkv": ours, "hf": theirs})
        ratio = f"{ours / theirs:.2f}x" if theirs else "-"
        print(f"{phase:<9}{batch:>6}{ctx:>9}{ours:>16.1f}{(theirs or 0):>11.1f}{ratio:>8}")
    dec = {(r["batch"], r["context"]): r["hybridkv"] for r in results if r["phase"] == "decode"}
    print(f"# decode 2K -> 16K at batch 1: {100 * (1 - dec[(1, 16384)] / dec[(1, 2048)]):+.1f}% drop")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
