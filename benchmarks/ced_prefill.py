"""V4.1 prefill tokens/s with CED (decoder layers over the rows a later step reads) and without.

    OMP_NUM_THREADS=1 python benchmarks/ced_prefill.py [--model DIR] [--lengths 4096,16384]
        [--window-policy zero] [--max-num-batched-tokens 2048]

Without --model it builds the `tiny-v41` recipe's model with the training init (random weights:
prefill time does not depend on what the weights learned). Each row is one request of that many
random tokens, generating one token, timed with process CPU time (other jobs on a shared machine
do not inflate it; run with OMP_NUM_THREADS=1), after a warm-up prefill of each kind. Also
printed: the rows the decoder skipped and their weight matmul FLOPs (EngineStats.ced_skipped_rows / ced_skipped_flops).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.config import ModelConfig  # noqa: E402
from hybridkv.engine import EngineConfig, SamplingParams  # noqa: E402
from hybridkv.engine.core import EngineCore  # noqa: E402
from hybridkv.model import Transformer  # noqa: E402


def build_model(model_dir: str | None) -> Transformer:
    if model_dir:
        from hybridkv.weights import load_model
        return load_model(model_dir)[0]
    from hybridkv.train.init import init_weights
    from hybridkv.train.recipes import TINY_V41_MODEL, get_recipe
    d = dict(TINY_V41_MODEL, vocab_size=get_recipe("tiny-v41").vocab_size)
    model = Transformer(ModelConfig.from_dict(d))
    init_weights(model, seed=0)
    return model.eval()


def prefill(model: Transformer, length: int, ced: bool, args) -> dict:
    ec = EngineConfig(ced_prefill=ced, window_policy=args.window_policy,
                      max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=1,
                      num_blocks=length // 128 + 4)
    eng = EngineCore(model, None, "bench", ec)
    g = torch.Generator().manual_seed(length)
    prompt = torch.randint(2, model.config.vocab_size, (length,), generator=g).tolist()
    eng.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    t = time.process_time()
    while eng.has_unfinished():
        eng.step()
    dt = time.process_time() - t
    return {"length": length, "ced": ced, "tokens_per_s": length / dt, "seconds": dt,
            "skipped_rows": eng.stats.ced_skipped_rows, "skipped_gflop": eng.stats.ced_skipped_flops / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a V4.1 model directory (default: tiny-v41, random init)")
    ap.add_argument("--lengths", default="4096,16384")
    ap.add_argument("--window-policy", default="zero")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    model = build_model(args.model)
    if model.config.family != "v4.1":
        raise SystemExit("CED is a V4.1 prefill path: give a V4.1 model")
    for ced in (False, True):   # warm-up: the first forwards of a process pay one-time costs
        prefill(model, 1024, ced, args)
    rows = []
    print(f"# {date.today()} {platform.processor() or platform.machine()} torch {torch.__version__} "
          f"threads {torch.get_num_threads()} policy {args.window_policy} chunk {args.max_num_batched_tokens}")
    for n in (int(x) for x in args.lengths.split(",")):
        for ced in (False, True):
            r = prefill(model, n, ced, args)
            rows.append(r)
            print(f"prefill {n:>6}  ced={'on ' if ced else 'off'}  {r['tokens_per_s']:8.1f} tok/s  "
                  f"{r['seconds']:6.2f} s  skipped rows {r['skipped_rows']}  ({r['skipped_gflop']:.1f} GFLOP)")
        print(f"  speedup at {n}: {rows[-1]['tokens_per_s'] / rows[-2]['tokens_per_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
