"""Run the evaluation suite through the engine under memory policies, and record accuracy and the
KV bytes each request held on the device (from the allocator, by kind).

Every (policy, task, length) cell generates `samples` prompts (seeds 0..n-1, needle depths spread
evenly), submits them to one engine together (continuous batching), scores the greedy outputs, and
records each request's device-resident KV bytes when it finished.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridkv.engine import LLM, SamplingParams
from hybridkv.eval.scoring import leading_match_all, mrcr_score, string_match_all, string_match_part, word_match_all
from hybridkv.eval.tasks import NEEDLE_TASKS, EvalSample, make_eval_sample
from hybridkv.tasks.generators import Pools
from hybridkv.tasks.tokenizer import TaskTokenizer


@dataclass
class SampleResult:
    task: str
    length: int
    prompt_tokens: int
    depth: float | None
    score: float
    output: str
    references: list[str]
    device_kv_bytes: dict[str, int]


@dataclass
class EvalRun:
    model: str
    policy: str
    tasks: list[str]
    lengths: list[int]
    samples: int
    seconds: float = 0.0
    results: list[SampleResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "EvalRun":
        d = dict(d)
        d["results"] = [SampleResult(**r) for r in d["results"]]
        return cls(**d)

    def cell(self, task: str, length: int) -> list[SampleResult]:
        return [r for r in self.results if r.task == task and r.length == length]

    def accuracy(self, task: str, length: int) -> float | None:
        rs = self.cell(task, length)
        return 100 * statistics.fmean(r.score for r in rs) if rs else None

    def word_accuracy(self, task: str, length: int) -> float | None:
        """The strict score (whole-word match of every reference), from the stored outputs."""
        return self._rescored(task, length, word_match_all)

    def leading_accuracy(self, task: str, length: int) -> float | None:
        """The strictest score (the references are the output's first words), from the stored outputs."""
        return self._rescored(task, length, leading_match_all)

    def _rescored(self, task: str, length: int, scorer) -> float | None:
        rs = self.cell(task, length)
        return 100 * statistics.fmean(scorer(r.output, r.references) for r in rs) if rs else None

    def device_kv(self, length: int, kind: str | None = None) -> float | None:
        """Mean device-resident KV bytes per request at this length (all kinds, or one)."""
        rs = [r for r in self.results if r.length == length]
        if not rs:
            return None
        return statistics.fmean(sum(r.device_kv_bytes.values()) if kind is None else r.device_kv_bytes.get(kind, 0)
                                for r in rs)


def score(sample: EvalSample, output: str) -> float:
    if sample.metric == "mrcr":
        return mrcr_score(output.strip(), sample.references[0], sample.meta["prefix"])
    if sample.metric == "string_match_part":
        return string_match_part(output, sample.references)
    return string_match_all(output, sample.references)


def build_samples(tok: TaskTokenizer, tasks: list[str], lengths: list[int], n: int, seed: int = 0,
                  progress=None) -> list[tuple[int, EvalSample]]:
    pools = Pools(tok, seed=seed, prose_split="eval")     # real-text haystacks: the held-out prose
    out = []
    for task in tasks:
        for length in lengths:
            for i in range(n):
                depth = (i + 0.5) / n if task in NEEDLE_TASKS else None
                out.append((length, make_eval_sample(task, seed * 100_000 + i, pools, length, depth)))
                if progress:
                    progress()
    return out


def run_policy(model_dir: str | Path, policy: str, samples: list[tuple[int, EvalSample]], tok: TaskTokenizer,
               tasks: list[str], lengths: list[int], n: int, device: str = "cpu", progress=None,
               dtype: str | torch.dtype | None = "auto", **engine_options) -> EvalRun:
    """One policy's run over `samples`. `engine_options` are EngineConfig fields; the device pool,
    the longest request and the step budget are sized to the samples and the tiers below the device
    are off, unless given."""
    longest = max(len(s.prompt) + s.max_new_tokens for _, s in samples)
    block = 128
    seqs = engine_options.get("max_num_seqs", 8)
    sized = dict(max_num_seqs=seqs, num_blocks=seqs * (-(-longest // block) + 1) + 8,
                 max_model_len=max(longest + 1, 4096), max_num_batched_tokens=max(2048, min(longest, 16384)),
                 tiers={"dram_bytes": 0})
    llm = LLM(model_dir, device=device, dtype=dtype, **{**sized, **engine_options, "memory_policy": policy})
    indexer = engine_options.get("indexer", "native")
    label = policy if indexer == "native" else f"{policy}+{indexer}-indexer"
    if llm.model.dtype != torch.float32:       # results of another compute dtype stay apart
        label += f"+{str(llm.model.dtype).removeprefix('torch.')}"
    run = EvalRun(str(model_dir), label, tasks, lengths, n)
    t0 = time.perf_counter()
    eng = llm.engine
    pending = {}
    for length, sample in samples:
        params = SamplingParams(max_tokens=sample.max_new_tokens, stop_token_ids=[tok.eos_id])
        seq = eng.add_request(sample.prompt, params)
        pending[seq.request_id] = (length, sample, seq)
    while eng.has_unfinished():
        for ev in eng.step():
            if ev.finished and progress:
                progress()
    for rid, (length, sample, seq) in pending.items():
        text = tok.decode(seq.output_ids)
        run.results.append(SampleResult(sample.task, length, len(sample.prompt), sample.depth, score(sample, text),
                                        text, sample.references, seq.device_kv_bytes or {}))
    run.seconds = time.perf_counter() - t0
    eng.store.pool.check()
    llm.close()
    return run
