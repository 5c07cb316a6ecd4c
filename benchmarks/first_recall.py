"""Where FlashMemory's first recall puts each evaluation prompt's needle: the engine prefills the
prompts of the evaluation's task generators under `flashmemory-B` (two output tokens: a request
that its first token ends recalls nothing), the chunk probabilities of the first recall (the
prompt's last row and the mean over its last 32 rows) are kept, the needle is located by its
answer's tokens in the prompt, and each block ranking ("max": a block's most probable chunk;
"count": its chunks above 0.5, FlashMemory's paper) with each division of the budget between the
two scores ("turns") is applied to the same probabilities. Prints, per prompt, the needle's
blocks and their place under each score, then how many prompts keep all of their needle's blocks
under each variant. A kept block is not an answer: the engine's evaluation (`hybridkv eval
--memory-policy ...`) is the measure; this says why a recall lost one.

    python benchmarks/first_recall.py --model models/tiny-v4 --tasks passkey,niah_single_2,niah_multikey_1 \\
        --length 32768 --samples 16 --seed 3000 [--device cuda] [--budget 0.15]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hybridkv.engine import LLM, SamplingParams  # noqa: E402
from hybridkv.eval.runner import build_samples  # noqa: E402
from hybridkv.memory.policies import FlashMemory  # noqa: E402
from hybridkv.tasks.tokenizer import TaskTokenizer  # noqa: E402

TURNS = {"1:3": (1, 3), "1:1": (1, 1), "last row": (1, 0), "mean": (0, 1)}


class RecordingFlashMemory(FlashMemory):
    """FlashMemory that keeps each request's first-recall chunk probabilities [2, visible]."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.first: dict[str, torch.Tensor] = {}

    def resident(self, ctx):
        probs = ctx.extra.get("chunk_probs")
        if probs is not None and probs.dim() == 2 and ctx.request_id not in self.first:
            self.first[ctx.request_id] = probs.clone()
        return super().resident(ctx)


def needle_positions(prompt: list[int], answer: str, tok: TaskTokenizer) -> list[int]:
    """Where the answer's tokens start in the prompt (every occurrence)."""
    for text in (" " + answer, answer):
        ids = tok.encode(text)
        found = [j for j in range(len(prompt) - len(ids) + 1) if prompt[j:j + len(ids)] == ids]
        if found:
            return found
    return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny-v4"))
    ap.add_argument("--tasks", default="passkey,niah_single_2,niah_multikey_1")
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--samples", type=int, default=16, help="prompts per task")
    ap.add_argument("--seed", type=int, default=3000, help="the evaluation uses 2000: choose on others")
    ap.add_argument("--budget", type=float, default=0.15)
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    tok = TaskTokenizer.load(a.model)
    tasks = a.tasks.split(",")
    samples = build_samples(tok, tasks, [a.length], a.samples, seed=a.seed)
    recorder = RecordingFlashMemory(a.budget)
    llm = LLM(a.model, device=a.device, memory_policy=recorder, enable_prefix_caching=False, max_num_seqs=1,
              num_blocks=a.length // 128 + 16, max_model_len=a.length + 256, max_num_batched_tokens=16384,
              tiers={"dram_bytes": 0})
    block_tokens = llm.engine.store.block_tokens
    block_chunks = block_tokens // llm.engine.model.layers[recorder.scorer.config.layers[0]].attn.ratio
    variants = {(rank, turns): FlashMemory(a.budget, rank=rank, turns=TURNS[turns])
                for rank in FlashMemory.RANKINGS for turns in TURNS}
    rankings = {rank: variants[(rank, "1:3")] for rank in FlashMemory.RANKINGS}
    kept = {v: 0 for v in variants}
    print(f"# {a.model}, {a.length} tokens, budget {a.budget}, seed {a.seed}, {len(samples)} prompts")
    print("| task | depth | needle blocks | of | place by max (last row / mean) | place by count (last row / mean) | "
          + " | ".join(f"{r} {t}" for r, t in variants) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(variants))
    for _, sample in samples:
        out = llm.generate([sample.prompt], SamplingParams(max_tokens=2, ignore_eos=True))[0]
        probs = recorder.first.pop(out.request_id)
        complete = probs.shape[-1] // block_chunks
        blocks = sorted({p // block_tokens for p in needle_positions(sample.prompt, sample.references[0], tok)
                         if p // block_tokens < complete})
        places = {}
        for rank, policy in rankings.items():
            keys = policy.block_ranks(probs, complete, block_chunks).numpy()
            orders = [np.argsort(-k, kind="stable") for k in keys]
            places[rank] = " / ".join(",".join(str(int(np.flatnonzero(o == b)[0])) for b in blocks) for o in orders)
        marks = []
        for v, policy in variants.items():
            keep = policy.blocks(probs, probs.shape[-1], block_chunks).numpy()
            ok = bool(blocks) and all(keep[b] for b in blocks)
            kept[v] += ok
            marks.append("yes" if ok else "no")
        print(f"| {sample.task} | {sample.depth:.3f} | {','.join(map(str, blocks)) or '—'} | {complete} | "
              f"{places['max']} | {places['count']} | " + " | ".join(marks) + " |", flush=True)
    print("\nprompts whose needle blocks the first recall keeps:")
    for (rank, turns), n in kept.items():
        print(f"  {rank:5s} turns {turns:8s} {n} of {len(samples)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
