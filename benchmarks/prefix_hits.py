"""Prefix-cache hit rate of a multi-turn agent workload under each window policy.

Workload: a conversation of 20 turns; turn k's prompt is the whole previous conversation (prompts
and replies) plus a new message of 200-2000 tokens; the engine generates a short reply each turn.
A second run interleaves two such conversations, turn by turn. Hit rate = cached prompt tokens /
prompt tokens over all turns; "of cacheable" = cached / the whole 128-token blocks of each turn's
shared history (the new message and the history's last partial block can never hit) (vLLM users report 0% on V4: the hybrid coordinator takes the minimum
hit over cache groups, and transient window blocks evict older prefixes).

    python benchmarks/prefix_hits.py [--model DIR] [--turns 20] [--policies full,checkpoint(1024),zero]
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

from hybridkv.engine import LLM, SamplingParams  # noqa: E402


def conversation(seed: int, turns: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(torch.randint(200, 2001, (1,), generator=g)),), generator=g).tolist()
            for _ in range(turns)]


def run(llm: LLM, convs: list[list[list[int]]], reply_tokens: int) -> dict:
    histories = [[] for _ in convs]
    prompt_tokens = cached = cacheable = 0
    block = llm.engine.store.block_tokens
    per_turn = []
    for turn in range(len(convs[0])):
        for c, msgs in enumerate(convs):
            prompt = histories[c] + msgs[turn]
            out = llm.generate([prompt], SamplingParams(max_tokens=reply_tokens, ignore_eos=True))[0]
            if out.error:
                raise RuntimeError(out.error)
            prompt_tokens += len(prompt)
            cached += out.cached_tokens
            cacheable += len(histories[c]) // block * block  # whole blocks of the shared history
            per_turn.append((c, turn, len(prompt), out.cached_tokens))
            histories[c] = prompt + out.output_ids
    llm.engine.store.pool.check()
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "hit_rate": cached / prompt_tokens,
            "cacheable_tokens": cacheable, "of_cacheable": cached / max(cacheable, 1), "turns": per_turn}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "tests" / "fixtures" / "v4-tiny"))
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--reply-tokens", type=int, default=256, help="tokens the model replies each turn")
    ap.add_argument("--policies", default="full,checkpoint(1024),zero")
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    results = {}
    print(f"# prefix hits, {a.turns} turns, model {Path(a.model).name}, {date.today()}, "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    print(f"{'policy':<18}{'workload':<16}{'prompt tok':>11}{'cached':>10}{'hit rate':>10}"
          f"{'of cacheable':>14}{'seconds':>9}")
    for policy in a.policies.split(","):
        for name, seeds in (("1 conversation", [1]), ("2 interleaved", [2, 3])):
            llm = LLM(a.model, num_blocks=a.num_blocks, max_num_seqs=4, window_policy=policy, max_model_len=1 << 16)
            convs = [conversation(s, a.turns, llm.config.vocab_size) for s in seeds]
            t = time.perf_counter()
            r = run(llm, convs, a.reply_tokens)
            r["seconds"] = time.perf_counter() - t
            results[f"{policy}/{name}"] = r
            print(f"{policy:<18}{name:<16}{r['prompt_tokens']:>11}{r['cached_tokens']:>10}"
                  f"{100 * r['hit_rate']:>9.1f}%{100 * r['of_cacheable']:>13.1f}%{r['seconds']:>9.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
