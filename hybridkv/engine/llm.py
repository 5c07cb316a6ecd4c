"""The public offline API: `LLM(model_dir).generate(prompts, SamplingParams)` and `.stream(...)`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from hybridkv.engine.config import EngineConfig, resolve_dtype
from hybridkv.engine.core import EngineCore, Event
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.sequence import Sequence
from hybridkv.engine.tokenizer import Tokenizer
from hybridkv.errors import RequestError
from hybridkv.memory import parse_policy
from hybridkv.memory.indexer import FILENAME as MEMORY_INDEXER_FILE
from hybridkv.weights import checkpoint_identity, load_model


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int = 0
    replayed_tokens: int = 0
    ttft: float | None = None
    latency: float | None = None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    spec_steps: int = 0              # speculative decoding: verify steps, draft tokens, accepted drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per verify step (accepted drafts + the model's own token); None without drafts."""
        return 1 + self.spec_accepted_tokens / self.spec_steps if self.spec_steps else None

    @classmethod
    def of(cls, seq: Sequence) -> "RequestOutput":
        return cls(seq.request_id, list(seq.prompt_ids), list(seq.output_ids), seq.text, seq.finish_reason, seq.error,
                   seq.num_cached_tokens, seq.num_replayed_tokens, seq.ttft,
                   None if seq.finish_time is None else seq.finish_time - seq.arrival, list(seq.logprobs),
                   list(seq.top_logprobs), seq.spec_steps, seq.spec_draft_tokens, seq.spec_accepted_tokens)


class LLM:
    """Offline generation with continuous batching, chunked prefill and prefix caching."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype | str | None = "auto",
                 engine_config: EngineConfig | None = None, **engine_options):
        """`dtype` "auto" (or None) computes in bfloat16 on CUDA and float32 elsewhere; the engine's
        options are `engine_config`, with `engine_options` (EngineConfig fields) over it."""
        self.model_dir = Path(model_dir)
        ec = replace(engine_config, **engine_options) if engine_config is not None else EngineConfig(**engine_options)
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        if ec.tensor_parallel_size > 1:    # ranks 1.. in their own processes; this one is rank 0
            from hybridkv.engine import sharded
            self.engine, self.model = sharded.build_engine(self.model_dir, device, dtype, ec)
            self.config = self.model.config
            return
        self.model, self.config = load_model(self.model_dir, device=device, dtype=resolve_dtype(dtype, device))
        if ec.memory_indexer is None and parse_policy(ec.memory_policy).needs_query:
            ec = replace(ec, memory_indexer=str(self.model_dir / MEMORY_INDEXER_FILE))
        self.engine = EngineCore(self.model, self.tokenizer, checkpoint_identity(self.model_dir), ec)

    def close(self) -> None:
        """Finish pending prefix-cache writes (disk, Redis) and release the tiers."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, prompts, params) -> list[Sequence | RequestOutput]:
        if isinstance(prompts, (str, tuple)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts")
        out = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                out.append(self.engine.add_request(prompt, SamplingParams() if p is None else p))
            except RequestError as e:  # this request is refused; the others run
                out.append(RequestOutput(f"rejected-{i}", [], [], finish_reason="error", error=str(e)))
        return out

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt (text or token ids) to completion; outputs in prompt order. A prompt the
        engine cannot take comes back with finish_reason "error" and the reason; the rest run."""
        seqs = self._submit(prompts, params)
        while self.engine.has_unfinished():
            self.engine.step()
        return [s if isinstance(s, RequestOutput) else RequestOutput.of(s) for s in seqs]

    def stream(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[Event]:
        """Token events of all prompts as they are produced."""
        seqs = self._submit(prompts, params)
        for s in seqs:
            if isinstance(s, RequestOutput):
                yield Event(s.request_id, None, finished=True, finish_reason="error", text=s.error or "")
        while self.engine.has_unfinished():
            yield from self.engine.step()
