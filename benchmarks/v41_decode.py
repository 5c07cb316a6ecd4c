"""V4.1 decode tokens/s, batched decode against one-token segments (EngineConfig.batched_decode).

    OMP_NUM_THREADS=1 python benchmarks/v41_decode.py [--model DIR] [--batch 4] [--context 2048]
        [--decode-tokens 32]

Without --model it builds the `tiny-v41` recipe's model with the training init (random weights:
decode time does not depend on what the weights learned). `batch` requests of `context` random
tokens are prefilled, then every step decodes one token for each; the decode steps alone are timed
with process CPU time (other jobs on a shared machine do not inflate it; run with OMP_NUM_THREADS=1).
The two paths compute the same logits bit for bit (tests/test_v41_batched_decode.py); the outputs
of both runs are compared here too.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ced_prefill import build_model  # noqa: E402

from hybridkv.engine import EngineConfig, SamplingParams  # noqa: E402
from hybridkv.engine.core import EngineCore  # noqa: E402


def decode(model, batched: bool, args) -> tuple[float, list[list[int]]]:
    ec = EngineConfig(batched_decode=batched, max_num_seqs=args.batch, max_num_batched_tokens=2048,
                      num_blocks=args.batch * (args.context + args.decode_tokens + 256) // 128 + 8,
                      enable_prefix_caching=False)
    eng = EngineCore(model, None, "bench", ec)
    g = torch.Generator().manual_seed(args.context + args.batch)
    seqs = [eng.add_request(torch.randint(2, model.config.vocab_size, (args.context,), generator=g).tolist(),
                            SamplingParams(max_tokens=args.decode_tokens + 1, ignore_eos=True))
            for _ in range(args.batch)]
    while eng.scheduler.waiting or any(s.in_prefill for s in eng.scheduler.running):
        eng.step()
    eng.step()   # every request has its first token: decode from here
    produced, t = 0, time.process_time()
    while eng.has_unfinished():
        produced += len(eng.step())
    return produced / (time.process_time() - t), [s.output_ids for s in seqs]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a V4.1 model directory (default: tiny-v41, random init)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--decode-tokens", type=int, default=32)
    args = ap.parse_args()
    model = build_model(args.model)
    if model.config.family != "v4.1":
        raise SystemExit("give a V4.1 model")
    print(f"# {date.today()} {platform.processor() or platform.machine()} torch {torch.__version__} "
          f"threads {torch.get_num_threads()} batch {args.batch} context {args.context} "
          f"decode tokens {args.decode_tokens}")
    with torch.inference_mode():
        for batched in (False, True):   # warm-up: the first forwards of a process pay one-time costs
            decode(model, batched, argparse.Namespace(batch=args.batch, context=256, decode_tokens=4))
        seg, seg_out = decode(model, False, args)
        bat, bat_out = decode(model, True, args)
    print(f"one-token segments {seg:8.1f} tok/s")
    print(f"batched decode     {bat:8.1f} tok/s   {bat / seg:.2f}x   same outputs: {bat_out == seg_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
