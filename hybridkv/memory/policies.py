"""Resident-set policies for CSA main KV.

The unit is the KV block (128 native positions = 32 CSA entries in every CSA layer). A policy
names the blocks of a request whose CSA main entries stay on the device; the others live only in
host memory and cannot be selected by the indexer or attended to. HCA entries, indexer keys,
the window and compressor state always stay on the device (FlashMemory's split too). The block
being filled is always resident. Policies run when a request's prefill ends and then every
`interval` decode steps.

- `full`: every block (no offload).
- `recency-N`: the blocks holding the last N tokens.
- `random-p`: a random fraction p of the complete blocks, redrawn every interval, plus the newest.
- `oracle-K`: the K blocks (K < 1: that fraction of the complete blocks) with the highest
  attention mass from the prompt's final query tokens with full attention (an upper bound that
  reads the question).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

import torch

from hybridkv.errors import ConfigError


@dataclass
class PolicyContext:
    """What a policy may look at for one request."""

    request_id: str
    num_blocks: int            # blocks the request holds (the last one is being filled)
    position: int              # positions computed so far
    block_tokens: int
    decode_steps: int          # decode steps since the prefill ended
    seed: int = 0
    attention_mass: torch.Tensor | None = None   # [num_complete_blocks] (oracle), from the prompt's end
    extra: dict = field(default_factory=dict)


class MemoryPolicy:
    name = "full"
    interval = 64
    offloads = False
    needs_attention_mass = False

    def resident(self, ctx: PolicyContext) -> set[int]:
        return set(range(ctx.num_blocks))

    def __str__(self) -> str:
        return self.name


class Recency(MemoryPolicy):
    offloads = True

    def __init__(self, tokens: int):
        if tokens <= 0:
            raise ConfigError(f"recency needs a positive token count, got {tokens}")
        self.tokens, self.name = tokens, f"recency-{tokens}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        first = max(0, (ctx.position - self.tokens) // ctx.block_tokens)
        return set(range(first, ctx.num_blocks)) | {ctx.num_blocks - 1}


class RandomBlocks(MemoryPolicy):
    offloads = True

    def __init__(self, fraction: float):
        if not 0 < fraction <= 1:
            raise ConfigError(f"random needs a fraction in (0, 1], got {fraction}")
        self.fraction, self.name = fraction, f"random-{fraction:g}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        complete = ctx.num_blocks - 1
        rng = random.Random(f"{ctx.seed}/{ctx.request_id}/{ctx.decode_steps // self.interval}")
        k = round(self.fraction * complete)
        return set(rng.sample(range(complete), k)) | {ctx.num_blocks - 1}


class OracleTopK(MemoryPolicy):
    offloads = True
    needs_attention_mass = True

    def __init__(self, k: float):
        if k <= 0:
            raise ConfigError(f"oracle needs a positive block count or fraction, got {k}")
        self.k, self.name = k, f"oracle-{k:g}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        mass = ctx.attention_mass
        complete = ctx.num_blocks - 1
        if mass is None:
            raise RuntimeError("oracle policy without captured attention mass")
        k = round(self.k * complete) if self.k < 1 else int(self.k)
        top = torch.topk(mass[:complete].float(), min(k, complete)).indices.tolist() if complete else []
        return set(top) | {ctx.num_blocks - 1}


def parse_policy(spec: str | MemoryPolicy | None) -> MemoryPolicy:
    """'full', 'recency-2048', 'random-0.1', 'oracle-0.1' or 'oracle-8' (blocks)."""
    if isinstance(spec, MemoryPolicy):
        return spec
    t = (spec or "full").strip().lower()
    if t == "full":
        return MemoryPolicy()
    m = re.fullmatch(r"(recency|random|oracle)[-:=(]?([0-9.]+[km]?)\)?", t)
    if not m:
        raise ConfigError(f"unknown memory policy {spec!r}; use full, recency-N, random-p or oracle-K")
    kind, value = m.groups()
    if kind == "recency":
        mult = {"k": 1024, "m": 1 << 20}.get(value[-1], 1)
        return Recency(int(float(value.rstrip("km")) * mult))
    if kind == "random":
        return RandomBlocks(float(value))
    return OracleTopK(float(value))
