"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, top-N
logprobs. Everything runs on float32 logits of the rows that end a request's known tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.errors import RequestError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_k: int = 0                    # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # number of top logprobs to return per generated token
    cache_salt: str | None = None     # tenants with different salts never share prefixes

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise RequestError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be between 0 and 20, got {self.logprobs}")


@dataclass
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled (temperature > 0) request draws from: float32 logits [vocab] scaled
    by the temperature, cut by top-k and top-p, softmaxed. Speculative decoding's rejection sampling
    compares the target's and the draft's distributions after the same processing."""
    scaled = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(0, order, sorted_logits)
    return torch.softmax(scaled, -1)


def scored(logits: torch.Tensor, token: int, params: SamplingParams) -> Sampled:
    """A chosen token with its logprob (under the unprocessed logits) and the top-N logprobs."""
    logprobs = torch.log_softmax(logits.float(), -1)
    top = None
    if params.logprobs:
        v, i = torch.topk(logprobs, params.logprobs)
        top = list(zip(i.tolist(), v.tolist()))
    return Sampled(token, float(logprobs[token]), top)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> Sampled:
    """One token from float32 logits [vocab]."""
    logits = logits.float()
    if params.temperature == 0:
        token = int(torch.argmax(logits))
    else:
        token = int(torch.multinomial(filtered_probs(logits, params), 1, generator=generator))
    return scored(logits, token, params)
