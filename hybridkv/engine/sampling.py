"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, per-request seeds, top-N
logprobs. Everything runs on float32 logits of the rows that end a request's known tokens.

`sample_rows` samples a whole step's rows with one transfer to the host (a decode step of 64
requests would otherwise wait for the device twice per request); `sample` is one row of it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridkv.errors import RequestError
from hybridkv.ops.sampling import greedy_rows


GREEDY_BELOW = 1e-5        # a temperature below this samples greedily
MAX_TOP_K = 2**31 - 1
MAX_STOP_CHARS = 1024      # each stop string is checked against the output's end at every token


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
        """Raise RequestError naming what is wrong. A temperature below `GREEDY_BELOW` becomes 0
        (greedy), as in vLLM: dividing logits by it would overflow float32."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:        # (NaN too)
            raise RequestError(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise RequestError(f"top_k must be between 0 and {MAX_TOP_K}, got {self.top_k}")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise RequestError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {self.seed}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
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
    return filtered_probs_rows(logits[None], [params])[0]


def filtered_probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`filtered_probs` of every row of logits [R, vocab] under its own parameters (temperature > 0),
    in one pass over the rows: [R, vocab] float32."""
    scaled = logits.float() / _per_row([p.temperature for p in params], logits.device)
    ks = [min(p.top_k, scaled.shape[-1]) for p in params]
    if max(ks) > 0:
        top = torch.topk(scaled, max(ks), dim=-1).values
        if min(ks) == max(ks):
            kth = top[:, -1:]
        else:       # rows without top-k cut below −inf: nothing
            kth = top.gather(1, _per_row([max(k, 1) - 1 for k in ks], logits.device, torch.long))
            kth = kth.masked_fill(_per_row([k == 0 for k in ks], logits.device, torch.bool), float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if min(p.top_p for p in params) < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, -1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token); rows
        # without a top-p cut keep everything (their running mass may round past 1)
        top_p = _per_row([p.top_p if p.top_p < 1.0 else float("inf") for p in params], logits.device)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[:, 0].fill_(False)     # the most likely token stays (a top_p that rounds to 0 in float32)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        scaled = torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(scaled, -1)


def filtered_probs_fixed(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                         top_p: torch.Tensor) -> torch.Tensor:
    """`filtered_probs_rows` with each row's parameters as tensors [R] (top_k 0: no cut; top_p 1: no
    cut) and no branch on their values, so that a CUDA graph captured once serves any parameters: every
    row is sorted, cut by its top-k (ties with the k-th value kept) and its top-p, softmaxed. Rows with
    temperature 0 (greedy) get their distribution at temperature 1, for the caller to ignore."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).float()
    scaled = logits.float() / t[:, None]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    vocab = scaled.shape[-1]
    k = top_k.long().clamp(0, vocab)
    kth = sorted_logits.gather(1, (k - 1).clamp(min=0)[:, None])
    sorted_logits = sorted_logits.masked_fill((k[:, None] > 0) & (sorted_logits < kth), float("-inf"))
    probs = torch.softmax(sorted_logits, -1)
    cut_p = torch.where(top_p < 1.0, top_p.float(), torch.full_like(top_p, float("inf"), dtype=torch.float32))
    drop = (probs.cumsum(-1) - probs) >= cut_p[:, None]
    drop[:, 0].fill_(False)         # the most likely token stays (a top_p that rounds to 0 in float32)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.softmax(torch.full_like(scaled, float("-inf")).scatter(-1, order, sorted_logits), -1)


def draw_with_uniforms(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """A token from each row of non-negative weights [R, vocab] (not necessarily normalised; each row
    with some positive weight) by inverting its cumulative sum at u [R] in [0, 1): fixed shapes and
    no host read, so it runs inside a CUDA graph with uniforms drawn before the replay. Never a token
    of weight 0 (the target stays below the row's total, which rounding of u · total could reach)."""
    c = weights.float().cumsum(-1)
    total = c[:, -1:]
    target = torch.minimum(u.float()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(c, target, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


def _per_row(values: list, device: torch.device, dtype: torch.dtype = torch.float32):
    """One value a row as a [R, 1] tensor on `device` (a Python scalar when every row's is the same).
    Through pinned memory on CUDA: a copy from pageable memory would wait for the queued steps."""
    if all(v == values[0] for v in values) and dtype is torch.float32:
        return values[0]
    host = torch.tensor(values, dtype=dtype)[:, None]
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


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
    take one argmax together, unseeded sampled rows one filtered draw together; a seeded row draws
    from its own generator, as alone. The results reach the host in one transfer."""
    return draw_rows(logits, params, generators).host()


@dataclass
class Drawn:
    """A step's tokens drawn on the logits' device, not yet read by the host: the next decode step
    can take `tokens` as its input ids before the host has waited for them (engine/core.py)."""

    tokens: torch.Tensor                 # [B] int64
    chosen: torch.Tensor                 # [B] float32: each token's logprob
    top: tuple[torch.Tensor, torch.Tensor] | None   # top-N logprobs (values, ids) [B, N], where asked
    params: list[SamplingParams]
    _pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def _parts(self) -> list[torch.Tensor]:
        return [self.tokens, self.chosen, *(self.top or ())]

    def start_transfer(self) -> None:
        """Queue the copy to the host now, so that `host` waits for this step's work only, not for
        a step queued on the device after it (a plain device-to-host copy waits for the stream)."""
        if self.tokens.device.type != "cuda" or self._pending is not None:
            return
        flat = torch.cat([t.reshape(-1).double() for t in self._parts()])
        buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        buf.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._pending = (buf, done)

    def host(self, rows: list[int] | None = None) -> list[Sampled]:
        """The draws as `Sampled` (one wait for the device); `rows`: only those, in that order."""
        if self.tokens.device.type == "cuda":
            self.start_transfer()
            buf, done = self._pending
            done.synchronize()
            parts = _split(buf, self._parts())
        else:
            parts = [t.tolist() for t in self._parts()]
        tokens_h, chosen_h = parts[0], parts[1]
        top_v, top_i = (parts[2], parts[3]) if self.top is not None else (None, None)
        out = []
        for i in (range(len(self.params)) if rows is None else rows):
            n = self.params[i].logprobs
            top = list(zip(top_i[i][:n], top_v[i][:n])) if n and top_v is not None else None
            out.append(Sampled(tokens_h[i], chosen_h[i], top))
        return out


def draw_rows(logits: torch.Tensor, params: list[SamplingParams],
              generators: list[torch.Generator | None]) -> Drawn:
    """`sample_rows` without the transfer: every draw stays on the logits' device."""
    logits = logits.float()
    if logits.shape[0] and all(p.temperature == 0 and not p.logprobs for p in params):   # the common decode step
        return Drawn(*greedy_rows(logits), None, list(params))
    tokens = torch.argmax(logits, -1)
    # a seeded row draws from its own generator as it would alone; the unseeded ones together
    for i, p in enumerate(params):
        if p.temperature != 0 and generators[i] is not None:
            tokens[i] = torch.multinomial(filtered_probs(logits[i], p), 1, generator=generators[i])[0]
    free = [i for i, p in enumerate(params) if p.temperature != 0 and generators[i] is None]
    if free:
        rows = torch.tensor(free)
        if logits.is_cuda:
            rows = rows.pin_memory().to(logits.device, non_blocking=True)
        probs = filtered_probs_rows(logits.index_select(0, rows), [params[i] for i in free])
        tokens.index_copy_(0, rows, torch.multinomial(probs, 1)[:, 0])
    logprobs = torch.log_softmax(logits, -1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_n = max((p.logprobs or 0 for p in params), default=0)
    top = None
    if top_n:
        top_v, top_i = torch.topk(logprobs, top_n, -1)
        top = (top_v, top_i)
    return Drawn(tokens, chosen, top, list(params))


def _split(flat: torch.Tensor, like: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[list]:
    """A host float64 buffer holding `like`'s values one after another -> each as nested lists."""
    out, at = [], 0
    for t in like:
        part = flat[at:at + t.numel()]
        at += t.numel()
        vals = part.long() if not t.is_floating_point() else part.float()
        out.append(vals.view(t.shape).tolist())
    return out
