"""Lightning Indexer scoring and causal top-k.

    I[s, j] = Σ_h w_h(s) · ReLU(q_h(s) · k_j)

Query s may select compressed entry j only when j < visible[s] (= (pos+1) // ratio); it keeps the
`topk` highest-scoring visible entries, or all of them when fewer exist. Unused slots are −1.

V4.1's hierarchical indexer adds a first level: the candidate source layer scores blocks of
`block_size` consecutive entries by their best entry, always keeps the block holding the query's
newest visible entry, and keeps the `topk_blocks` best blocks; later indexers take their top-k
inside that pool only. V4.1 lists the selected entries in position order.
"""

from __future__ import annotations

import torch

from hybridkv.ops.kv_formats import index_blocks_to_rows, unpack_index_fp4
from hybridkv.ops.paged import entry_rows


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H, d], weights [T, H], keys [N, d] -> scores [T, N] (float32)."""
    s = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu_()
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


def _score_elements(q: torch.Tensor) -> int:
    """Float32 [rows, heads, entries] products a selection holds at once: on the CPU what stays in
    cache (4 MiB), elsewhere 512 MiB."""
    return 1 << 20 if q.device.type == "cpu" else 1 << 27


def topk_in_row_slices(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
                       topk: int, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_topk(index_scores(...))` over slices of the rows whose [rows, H, N] float32 products
    stay small: every step is row-wise, and a prefill chunk of 8192 rows over 32K entries would
    otherwise hold 4 GiB at once (on the CPU, slices that stay in cache are also the faster).
    `excluded` [N] (bool): entries that score −inf."""
    step = max(1, _score_elements(q) // max(1, q.shape[1] * keys.shape[0]))
    parts = []
    for a in range(0, max(1, q.shape[0]), step):
        scores = index_scores(q[a:a + step], weights[a:a + step], keys)
        if excluded is not None:
            scores = scores.masked_fill(excluded, float("-inf"))
        parts.append(causal_topk(scores, visible[a:a + step], topk))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def mask_invisible(scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """scores [T, N] with entries j >= visible[t] set to −inf."""
    cols = torch.arange(scores.shape[-1], device=scores.device)
    return scores.masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))


def causal_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int, by_position: bool = False,
                masked: bool = False) -> torch.Tensor:
    """scores [T, N], visible [T] -> indices [T, min(topk, N)] of the best visible entries, −1 padded
    (at the end when `by_position`, which lists the selected entries in ascending order). `masked`:
    the scores are already −inf at entries j ≥ visible (`mask_invisible`'s, not applied again)."""
    n = scores.shape[-1]
    k = min(topk, n)
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    idx = (scores if masked else mask_invisible(scores, visible)).topk(k, dim=-1).indices
    if by_position:
        idx = idx.sort(dim=-1).values
    return torch.where(idx >= visible.unsqueeze(1), -1, idx)


def decode_keys(pool: torch.Tensor, fmt: str, dim: int) -> torch.Tensor:
    """A paged pool [blocks, E, width] of indexer keys in format `fmt` ("bf16"/float elements, or "fp4":
    68-B packed keys in the block layout) -> float32 [blocks·E, dim]."""
    if fmt == "fp4":
        return unpack_index_fp4(index_blocks_to_rows(pool, dim).reshape(-1, pool.shape[-1]), dim)
    return pool.reshape(-1, pool.shape[-1]).float()


def indexer_topk_paged(q: torch.Tensor, weights: torch.Tensor, batch, pool: torch.Tensor, topk: int, ratio: int = 4,
                       fmt: str = "bf16", head_dim: int | None = None,
                       resident: torch.Tensor | None = None) -> torch.Tensor:
    """Per request: gather its visible keys through its block table, score (−inf for entries of
    blocks whose `resident` page is < 0), causal top-k. [T, topk], −1 padded."""
    head_dim = head_dim or q.shape[-1]
    keys_all = decode_keys(pool, fmt, head_dim)
    vis = (batch.positions.long() + 1) // ratio
    out = torch.full((q.shape[0], topk), -1, dtype=torch.long, device=q.device)
    for r in range(batch.slots.shape[0]):
        toks = torch.nonzero(batch.token_req == r).flatten()
        if toks.numel() == 0:
            continue
        n = int(vis[toks].max())
        cols = torch.arange(n, device=q.device)
        rows = entry_rows(batch, torch.full_like(cols, r), cols, batch.block_tokens // ratio)
        host_only = None if resident is None else resident[r].long()[cols // (batch.block_tokens // ratio)] < 0
        sel = topk_in_row_slices(q[toks], weights[toks], keys_all[rows], vis[toks], topk, host_only)
        out[toks, : sel.shape[1]] = sel
    return out


def paged_scores(q: torch.Tensor, weights: torch.Tensor, batch, pool: torch.Tensor, ratio: int = 4,
                 fmt: str = "bf16", head_dim: int | None = None, max_visible: int | None = None) -> torch.Tensor:
    """Each row's scores over its request's visible entries, gathered through its block table:
    float32 [T, max_visible], −inf beyond a row's visible entries."""
    head_dim = head_dim or q.shape[-1]
    keys_all = decode_keys(pool, fmt, head_dim)
    vis = (batch.positions.long() + 1) // ratio
    n = int(vis.max()) if max_visible is None and vis.numel() else (max_visible or 0)
    cols = torch.arange(n, device=q.device)
    out = torch.full((q.shape[0], n), float("-inf"), device=q.device)
    for t in range(q.shape[0]):
        r = batch.token_req[t].long()
        v = int(vis[t])
        rows = entry_rows(batch, r.expand(v), cols[:v], batch.block_tokens // ratio)
        out[t, :v] = index_scores(q[t:t + 1], weights[t:t + 1], keys_all[rows])[0]
    return out


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
    """The candidate pool: scores [T, N] (invisible entries already −inf), visible [T] -> bool [T, N],
    True on the entries of the `topk_blocks` best blocks (a block scores its best entry), the
    block of the newest visible entry always among them; blocks with no visible entry never."""
    n = scores.shape[-1]
    pad = -n % block_size
    padded = torch.cat([scores, scores.new_full((scores.shape[0], pad), float("-inf"))], dim=-1)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    n_blocks = block_scores.shape[-1]
    newest = torch.div(visible - 1, block_size, rounding_mode="floor")
    blocks = torch.arange(n_blocks, device=scores.device)
    block_scores = block_scores.masked_fill(blocks.unsqueeze(0) == newest.unsqueeze(1), float("inf"))
    top = block_scores.topk(min(topk_blocks, n_blocks), dim=-1)
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block_size, dim=-1)[:, :n]
