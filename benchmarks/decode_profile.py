"""Where a CPU decode step of the engine goes: cProfile of N decode steps at a batch and context.

    python benchmarks/decode_profile.py [--model tests/fixtures/v4-tiny] [--batch 4] [--context 2048] [--steps 20]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    llm = LLM(a.model, num_blocks=a.batch * (a.context // 128 + 2), max_num_seqs=a.batch)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    for _ in range(a.batch):
        prompt = torch.randint(2, llm.config.vocab_size, (a.context,), generator=g).tolist()
        eng.add_request(prompt, SamplingParams(max_tokens=a.steps + 8, ignore_eos=True))
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()
    prof = cProfile.Profile()
    t, produced = time.perf_counter(), 0
    prof.enable()
    for _ in range(a.steps):
        produced += len(eng.step())
    prof.disable()
    dt = time.perf_counter() - t
    stats = pstats.Stats(prof)
    print(f"{a.steps} decode steps, batch {a.batch}, context {a.context}: {dt / a.steps * 1e3:.1f} ms/step "
          f"(under cProfile), {produced / dt:.0f} tok/s; {stats.total_calls / a.steps:.0f} Python calls/step")
    stats.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
