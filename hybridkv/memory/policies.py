"""Resident-set policies for CSA main KV.

The unit is the KV block (128 native positions = 32 CSA entries in every CSA layer). A policy
names the blocks of a request whose CSA main entries stay on the device; the others live only in
host memory and cannot be selected by the indexer or attended to. HCA entries, indexer keys,
the window and compressor state always stay on the device (FlashMemory's split too). The block
being filled is always resident. Policies run when a request's prefill ends and then every
`interval` decode steps.

A share p of the blocks (the `-p` of `recency`, `random`, `oracle` and `flashmemory` below 1) counts
the block being filled: a request holding n blocks keeps ⌊p·n⌋ of them, at least the one being
filled, so that its resident CSA main entries are at most that share of `full`'s.

- `full`: every block (no offload).
- `recency-N`: the blocks holding the last N tokens; `recency-p` (p < 1): the newest share p.
- `random-p`: a random share p of the blocks, redrawn every interval, the one being filled always.
- `oracle-K`: the K complete blocks (K < 1: a share of the blocks) with the highest
  attention mass from the prompt's final query tokens with full attention (an upper bound that
  reads the question).
- `flashmemory-B` (FlashMemory's lookahead recall; B, default 0.15, the resident share of the
  blocks): the memory indexer (`memory.indexer`) scores every existing chunk at the end of
  the prefill (twice: from the prompt's last position and as the mean over its last `query_rows`,
  32, positions, the two rankings taking turns, three blocks from the mean for one from the last
  row) and every 64 decode steps from the last position; the newest blocks (a share of the budget,
  `tail_share`, default a twelfth, at least one where the budget holds two complete blocks;
  `flashmemory-B-tailT` sets it) stay, then the blocks whose most probable chunk is the most
  probable (ties: the larger summed probability) up to the budget; `flashmemory-B-count` ranks
  them as FlashMemory's paper does, by their count of chunks above 0.5 (ties: the summed
  probability). FlashMemory's pages of 64 chunks are these blocks of 32. The engine supplies the
  probabilities (`PolicyContext.extra["chunk_probs"]`), or for a decode recall each block's
  ranking key (`"block_ranks"`, `FlashMemory.block_ranks`, with `"visible_chunks"`).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from hybridkv.errors import ConfigError


@dataclass
class PolicyContext:
    """What a policy may look at for one request."""

    request_id: str
    # blocks the request holds: the last one is being filled, or complete where `position` ends a block
    num_blocks: int
    position: int              # positions computed so far
    block_tokens: int
    decode_steps: int          # decode steps since the prefill ended
    seed: int = 0
    attention_mass: torch.Tensor | None = None   # [num_complete_blocks] (oracle), from the prompt's end
    extra: dict = field(default_factory=dict)


def complete_blocks_kept(share: float, complete: int) -> int:
    """The complete blocks a resident `share` of a request's blocks allows: ⌊share·(complete + 1)⌋
    blocks with the one being filled, which is always resident (at 32K, 256 blocks at 0.15: 37
    complete blocks and the one being filled, 14.8 %)."""
    # the tolerance keeps a product that is an integer in exact arithmetic (0.15 · 20) from flooring below it
    return max(1, math.floor(share * (complete + 1) + 1e-9)) - 1


class MemoryPolicy:
    name = "full"
    interval = 64
    offloads = False
    needs_attention_mass = False
    needs_query = False      # the engine scores chunks with the policy's memory indexer (`scorer`)

    def resident(self, ctx: PolicyContext) -> set[int]:
        return set(range(ctx.num_blocks))

    def resident_many(self, ctxs: list[PolicyContext]) -> list[set[int]]:
        """`resident` for the requests whose recall falls in the same step."""
        return [self.resident(ctx) for ctx in ctxs]

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def complete_blocks(ctx: PolicyContext) -> int:
        """The request's complete blocks: all it holds when its positions end a block (the next one,
        to be filled, is not yet allocated and counts towards a share when it is)."""
        return min(ctx.position // ctx.block_tokens, ctx.num_blocks)

    @classmethod
    def filling_blocks(cls, ctx: PolicyContext) -> set[int]:
        """The block being filled, always resident (none until the next one is allocated)."""
        return set(range(cls.complete_blocks(ctx), ctx.num_blocks))


class Recency(MemoryPolicy):
    offloads = True

    def __init__(self, tokens: int = 0, share: float | None = None):
        """The blocks holding the last `tokens` tokens, or the newest `share` of the blocks."""
        if share is not None:
            if not 0 < share < 1:
                raise ConfigError(f"recency needs a share in (0, 1), got {share}")
            self.tokens, self.share, self.name = 0, share, f"recency-{share:g}"
            return
        if tokens <= 0:
            raise ConfigError(f"recency needs a positive token count, got {tokens}")
        self.tokens, self.share, self.name = tokens, None, f"recency-{tokens}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        if self.share is not None:
            complete = self.complete_blocks(ctx)
            first = complete - complete_blocks_kept(self.share, complete)
        else:
            first = max(0, (ctx.position - self.tokens) // ctx.block_tokens)
        return set(range(first, ctx.num_blocks)) | self.filling_blocks(ctx)


class RandomBlocks(MemoryPolicy):
    offloads = True

    def __init__(self, fraction: float):
        if not 0 < fraction <= 1:
            raise ConfigError(f"random needs a fraction in (0, 1], got {fraction}")
        self.fraction, self.name = fraction, f"random-{fraction:g}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        complete = self.complete_blocks(ctx)
        rng = random.Random(f"{ctx.seed}/{ctx.request_id}/{ctx.decode_steps // self.interval}")
        k = complete_blocks_kept(self.fraction, complete)
        return set(rng.sample(range(complete), k)) | self.filling_blocks(ctx)


class OracleTopK(MemoryPolicy):
    offloads = True
    needs_attention_mass = True

    def __init__(self, k: float):
        if k <= 0:
            raise ConfigError(f"oracle needs a positive block count or fraction, got {k}")
        self.k, self.name = k, f"oracle-{k:g}"

    def resident(self, ctx: PolicyContext) -> set[int]:
        mass = ctx.attention_mass
        complete = self.complete_blocks(ctx)
        if mass is None:
            raise RuntimeError("oracle policy without captured attention mass")
        k = complete_blocks_kept(self.k, complete) if self.k < 1 else int(self.k)
        top = torch.topk(mass[:complete].float(), min(k, complete)).indices.tolist() if complete else []
        return set(top) | self.filling_blocks(ctx)


class FlashMemory(MemoryPolicy):
    offloads = True
    needs_query = True
    # the first recall's second score: the mean over the prompt's last rows (docs/training-log.md)
    query_rows = 32
    # the newest blocks' share of the budget (a twelfth: at 32K 72.5 % against a third's 65.0 %,
    # the same at 8K and 16K; docs/training-log.md)
    DEFAULT_TAIL_SHARE = 1 / 12
    # how a block's chunk probabilities rank it: "max", its most probable chunk (a needle is a few
    # chunks of a block; at 32K a needle's block has one or two chunks near 0.8 where other blocks
    # have many a little above 0.5, docs/training-log.md), or "count", the paper's count above 0.5
    RANKINGS = ("max", "count")
    # the summed probability breaks ties under "max" at this weight: below any difference of two
    # float32 probabilities of a block worth keeping, within float64's precision
    TIE_WEIGHT = 2.0 ** -48

    def __init__(self, budget: float = 0.15, tail_share: float = DEFAULT_TAIL_SHARE, turns: tuple[int, ...] = (1, 3),
                 rank: str = "max"):
        """tail_share: the share of the budget kept as the newest blocks before any ranking takes one.
        turns: with several scores (the first recall: the prompt's last row, then the mean over its
        last rows), how many blocks each ranking takes in a turn (1 and 3: the mean found the most
        needles at 32K, docs/training-log.md). rank: one of `RANKINGS`."""
        if rank not in self.RANKINGS:
            raise ConfigError(f"flashmemory ranks blocks by {' or '.join(self.RANKINGS)}, not {rank!r}")
        if not 0 < budget <= 1:
            raise ConfigError(f"flashmemory needs a resident share in (0, 1], got {budget}")
        if not turns or min(turns) < 0 or not sum(turns):
            raise ConfigError(f"flashmemory's turns must be counts ≥ 0, not all 0, got {turns}")
        if not 0 <= tail_share <= 1:
            raise ConfigError(f"flashmemory's tail share must be in [0, 1], got {tail_share}")
        self.budget, self.tail_share, self.turns, self.rank = budget, tail_share, tuple(turns), rank
        self.name = (f"flashmemory-{budget:g}" + (f"-tail{tail_share:.4g}" if tail_share != self.DEFAULT_TAIL_SHARE
                                                  else "") + ("-count" if rank == "count" else ""))
        self.scorer = None          # the memory indexer, attached by the engine

    def blocks(self, probs: torch.Tensor, visible: int, block_chunks: int) -> torch.Tensor:
        """bool [blocks of `visible` chunks]: the blocks this recall keeps (the block being filled
        always), from the chunk probabilities [≥ visible] of one query, or [V, ≥ visible] of several
        (the engine's first recall), whose block rankings then take turns filling the budget."""
        return torch.from_numpy(self._keep(probs, visible, block_chunks))

    def block_ranks(self, probs: torch.Tensor, blocks: int, block_chunks: int) -> torch.Tensor:
        """float64 [..., blocks]: the ranking key of the first `blocks` blocks from chunk probabilities
        [..., ≥ blocks · block_chunks]: the largest chunk probability ("max") or the count of chunks
        above 0.5 ("count") first, their summed probability breaking ties. The engine computes it on
        the device for every due request at once, so that a recall moves a key per block to the
        host, not a probability per chunk."""
        p = probs[..., :blocks * block_chunks].reshape(*probs.shape[:-1], blocks, block_chunks).double()
        if self.rank == "max":
            return p.amax(-1) + p.sum(-1) * self.TIE_WEIGHT
        return (p > 0.5).sum(-1).double() * (block_chunks + 1) + p.sum(-1)

    def _shares(self, complete: int) -> tuple[int, int, int]:
        """(complete blocks kept, the newest of them, those the ranking chooses) of a request with
        `complete` blocks and the one being filled. The newest take at least one block only where
        the budget leaves the ranking one too: at 2K, 16 blocks at 0.15 keep one complete block,
        and the ranking chooses it."""
        budget = complete_blocks_kept(self.budget, complete)
        tail = round(self.tail_share * budget)
        if budget >= 2:
            tail = max(1, tail)
        tail = min(budget, tail)
        return budget, tail, min(budget - tail, complete)

    def _keep(self, probs: torch.Tensor, visible: int, block_chunks: int) -> np.ndarray:
        """`blocks` in numpy: a recall ranks every due request's blocks on the host, a few small
        arrays each, where torch's per-operation cost would dominate."""
        n_blocks = -(-visible // block_chunks)
        complete = visible // block_chunks
        keep = np.zeros(n_blocks, dtype=bool)
        keep[complete:] = True
        _, tail, need = self._shares(complete)
        keep[complete - tail:complete] = True
        if need > 0:
            scores = probs.detach().float().cpu().reshape(-1, probs.shape[-1])
            rank = self.block_ranks(scores, complete, block_chunks).numpy()
            # the best first, the lower block among equals
            orders = [np.argsort(-r, kind="stable") for r in rank]
            if len(orders) == 1:
                free = orders[0][~keep[orders[0]]]
                keep[free[:need]] = True
            else:
                turns = self.turns[:len(orders)] + (1,) * (len(orders) - len(self.turns))
                ranked = [(iter(o.tolist()), t) for o, t in zip(orders, turns) if t > 0]
                while need > 0 and ranked:
                    for order in list(ranked):      # each ranking takes its turn's blocks, best first
                        blocks, turn = order
                        while turn > 0 and need > 0:
                            b = next((b for b in blocks if not keep[b]), None)
                            if b is None:               # this ranking has nothing left to give
                                ranked.remove(order)
                                break
                            keep[b], need, turn = True, need - 1, turn - 1
        return keep

    def chunks(self, probs: torch.Tensor, visible: int, block_chunks: int) -> torch.Tensor:
        """bool [visible]: the chunks of the blocks `blocks` keeps."""
        return self.blocks(probs, visible, block_chunks).repeat_interleave(block_chunks)[:visible]

    def resident_many(self, ctxs: list[PolicyContext]) -> list[set[int]]:
        """`resident` of each request; those with the engine's block ranking keys ranked together (a
        recall of a hundred requests is a hundred small rankings otherwise): per request the need-th
        largest key, the keys above it, and the lowest blocks holding it for what is left — the
        blocks `_keep`'s stable sort keeps, without a sort."""
        ranked = [i for i, ctx in enumerate(ctxs) if ctx.extra.get("block_ranks") is not None]
        out = [self.resident(ctx) if ctx.extra.get("block_ranks") is None else None for ctx in ctxs]
        if not ranked:
            return out
        shapes = []          # (complete blocks, newest kept, chosen by rank, blocks of the visible chunks)
        for i in ranked:
            visible, bc = ctxs[i].extra["visible_chunks"], ctxs[i].extra["block_chunks"]
            _, tail, need = self._shares(visible // bc)
            shapes.append((visible // bc, tail, need, -(-visible // bc)))
        width = max(1, max(c for c, _, _, _ in shapes))
        rank = np.full((len(ranked), width), -np.inf)       # the newest blocks are kept apart: not ranked
        for row, (i, (complete, tail, _, _)) in enumerate(zip(ranked, shapes)):
            rank[row, :complete - tail] = np.asarray(ctxs[i].extra["block_ranks"], dtype=np.float64)[:complete - tail]
        need = np.array([n for _, _, n, _ in shapes])
        kth = np.array([np.partition(rank[row], width - k)[width - k] if k else np.inf
                        for row, k in enumerate(need.tolist())])[:, None]
        above, at = rank > kth, rank == kth
        chosen = above | (at & (np.cumsum(at, axis=1) <= (need - above.sum(1))[:, None]))
        for row, (i, (complete, tail, _, n_blocks)) in enumerate(zip(ranked, shapes)):
            out[i] = set(np.flatnonzero(chosen[row]).tolist()) | set(range(complete - tail, n_blocks)) \
                | self.filling_blocks(ctxs[i])
        return out

    def resident(self, ctx: PolicyContext) -> set[int]:
        if ctx.extra.get("block_ranks") is not None:
            return self.resident_many([ctx])[0]
        probs = ctx.extra.get("chunk_probs")
        if probs is None:
            raise RuntimeError("flashmemory policy without memory-indexer scores")
        keep = self._keep(probs, probs.shape[-1], ctx.extra["block_chunks"])
        return set(np.flatnonzero(keep).tolist()) | self.filling_blocks(ctx)


def parse_policy(spec: str | MemoryPolicy | None) -> MemoryPolicy:
    """'full', 'recency-2048', 'recency-0.15' (a share of the blocks), 'random-0.1', 'oracle-0.1',
    'oracle-8' (blocks), 'flashmemory', 'flashmemory-0.15', 'flashmemory-0.15-tail0.333' (the share
    of the budget kept as the newest blocks, default a twelfth) and a '-count' after either (blocks
    ranked by their count of chunks above 0.5, the paper's ranking, instead of by their most
    probable chunk)."""
    if isinstance(spec, MemoryPolicy):
        return spec
    t = (spec or "full").strip().lower()
    if t == "full":
        return MemoryPolicy()
    if t in ("flashmemory", "flashmemory-count"):
        return FlashMemory(rank="count" if t.endswith("-count") else "max")
    m = re.fullmatch(r"(recency|random|oracle|flashmemory)[-:=(]?([0-9.]+[km]?)\)?(?:-tail([0-9.]+))?(-count)?", t)
    if not m or ((m.group(3) is not None or m.group(4) is not None) and m.group(1) != "flashmemory"):
        raise ConfigError(f"unknown memory policy {spec!r}; use full, recency-N, random-p, oracle-K or "
                          "flashmemory[-B[-tailT]][-count]")
    kind, value, tail, count = m.groups()
    try:
        number = float(value.rstrip("km"))
        tail_share = FlashMemory.DEFAULT_TAIL_SHARE if tail is None else float(tail)
    except ValueError:
        raise ConfigError(f"memory policy {spec!r}: {value!r} or {tail!r} is not a number") from None
    if kind == "recency":
        if number < 1 and value[-1] not in "km":
            return Recency(share=number)
        return Recency(int(number * {"k": 1024, "m": 1 << 20}.get(value[-1], 1)))
    if kind == "random":
        return RandomBlocks(number)
    if kind == "flashmemory":
        return FlashMemory(number, tail_share=tail_share, rank="count" if count else "max")
    return OracleTopK(number)
