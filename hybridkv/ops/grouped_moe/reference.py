"""Routed experts over tokens sorted by expert, by definition.

`sort_by_expert` orders the (token, slot) pairs of a routing by expert, stably (a token's pairs keep
token order within an expert), with torch operations only: no Python loop over experts and no value
read back by the host, so it runs inside a CUDA graph. `expert_tiles` cuts each expert's rows into
tiles of a kernel's row block, for a fixed-size grid. `combine` adds each token's expert outputs
in expert order, which is the per-expert loop's order of additions (so the loop's float32 sums are
reproduced bit for bit). `routed_experts` is the grouped computation with a dense GEMM per expert
segment: bit-identical with `MoE`'s per-expert loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class ExpertSort(NamedTuple):
    order: torch.Tensor     # [P] pair (t·k + slot) of each sorted row; experts ascending
    token: torch.Tensor     # [P] token of each sorted row
    expert: torch.Tensor    # [P] expert of each sorted row
    counts: torch.Tensor    # [E] rows per expert (zero for experts nobody chose)
    offsets: torch.Tensor   # [E + 1] first sorted row of each expert; offsets[E] = P
    inverse: torch.Tensor   # [P] sorted row of pair p


def sort_by_expert(ids: torch.Tensor, n_experts: int) -> ExpertSort:
    """ids [T, k] (int64 expert of each token's slot) -> the pairs sorted by expert."""
    t, k = ids.shape
    flat = ids.reshape(-1).long()
    expert, order = torch.sort(flat, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=ids.device))
    return ExpertSort(order, order // k, expert, counts, offsets, inverse)


def expert_tiles(sort: ExpertSort, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert, first row, end row) int32 per row tile of `block_m` sorted rows; a tile lies inside
    one expert's rows. The table has the most tiles any routing of this size can need,
    ceil(P / block_m) + min(E, P); unused entries have expert -1."""
    n_experts, p = sort.counts.shape[0], sort.order.shape[0]
    max_tiles = -(-p // block_m) + min(n_experts, p)
    tiles = (sort.counts + block_m - 1) // block_m
    cum = tiles.cumsum(0)
    t = torch.arange(max_tiles, device=cum.device)
    e = torch.searchsorted(cum, t, right=True)
    valid = e < n_experts
    ec = e.clamp(max=n_experts - 1)
    start = sort.offsets[ec] + (t - (cum[ec] - tiles[ec])) * block_m
    end = sort.offsets[ec + 1]
    return (torch.where(valid, ec, -1).int(), torch.where(valid, start, 0).int(), torch.where(valid, end, 0).int())


def combine(out: torch.Tensor, sort: ExpertSort, ids: torch.Tensor) -> torch.Tensor:
    """Sorted rows' outputs [P, D] -> float32 [T, D]: each token's rows added in expert order,
    starting from zero (the per-expert loop's sums exactly)."""
    t, k = ids.shape
    pos = sort.inverse.view(t, k).gather(1, ids.argsort(dim=1, stable=True))
    y = torch.zeros(t, out.shape[-1], dtype=torch.float32, device=out.device)
    for j in range(k):                       # k slots (6 in V4), not experts
        y = y + out[pos[:, j]].float()
    return y


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_experts: int,
                   expert_fn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, D], routing weights [T, k] and ids [T, k] -> float32 [T, D], the routed experts' sum.
    `expert_fn(e, rows, route)` is expert e on its sorted rows [n, D] with their routing weights
    [n, 1]. One call per expert segment (host-synchronising: the definition, not the GPU path)."""
    sort = sort_by_expert(ids, n_experts)
    xs, route = x[sort.token], weights.reshape(-1)[sort.order, None]
    out = torch.empty(xs.shape[0], x.shape[-1], dtype=x.dtype, device=x.device)
    offsets = sort.offsets.tolist()
    for e in range(n_experts):
        a, b = offsets[e], offsets[e + 1]
        if a < b:
            out[a:b] = expert_fn(e, xs[a:b], route[a:b])
    return combine(out, sort, ids)
