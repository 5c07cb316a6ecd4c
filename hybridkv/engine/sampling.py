"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, top-N
logprobs. Everything runs on float32 logits of the rows that end a request's known tokens.

`sample_rows` samples a whole step's rows with one transfer to the host (a decode step of 64
requests would otherwise wait for the device twice per request); `sample` is one row of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.errors import RequestError
from hybridkv.ops.sampling import greedy_rows


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
    return sample_rows(logits[None], [params], [generator])[0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> list[Sampled]:
    """A token from each row of logits [B, vocab] under that row's parameters and generator, with
    its logprob (under the unprocessed logits) and the top-N logprobs the row asks for. Greedy rows
    take one argmax together; a sampled row draws from its own generator, as alone. The results
    reach the host in one transfer."""
    logits = logits.float()
    rows = logits.shape[0]
    if rows == 0:
        return []
    if all(p.temperature == 0 and not p.logprobs for p in params):     # the common decode step
        tokens_h, chosen_h = _to_host(*greedy_rows(logits))
        return [Sampled(t, lp, None) for t, lp in zip(tokens_h, chosen_h)]
    tokens = torch.argmax(logits, -1)
    for i, p in enumerate(params):
        if p.temperature != 0:
            tokens[i] = torch.multinomial(filtered_probs(logits[i], p), 1, generator=generators[i])[0]
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_n = max(p.logprobs or 0 for p in params)
    if top_n:
        top_v, top_i = torch.topk(logprobs, top_n, -1)
        tokens_h, chosen_h, top_v, top_i = _to_host(tokens, chosen, top_v, top_i)
    else:
        tokens_h, chosen_h = _to_host(tokens, chosen)
    out = []
    for i, p in enumerate(params):
        top = list(zip(top_i[i][:p.logprobs], top_v[i][:p.logprobs])) if p.logprobs else None
        out.append(Sampled(tokens_h[i], chosen_h[i], top))
    return out


def _to_host(*tensors: torch.Tensor) -> list[list]:
    """Each tensor as nested lists, in one copy from the device (a single synchronisation)."""
    if tensors[0].device.type == "cpu":
        return [t.tolist() for t in tensors]
    flat = torch.cat([t.reshape(-1).double() for t in tensors]).cpu()
    out, at = [], 0
    for t in tensors:
        part = flat[at:at + t.numel()]
        at += t.numel()
        vals = part.long() if not t.is_floating_point() else part.float()
        out.append(vals.view(t.shape).tolist())
    return out
