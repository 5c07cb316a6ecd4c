"""Lightning Indexer scoring and causal top-k.

    I[s, j] = Σ_h w_h(s) · ReLU(q_h(s) · k_j)

Query s may select compressed entry j only when j < visible[s] (= (pos+1) // ratio); it keeps the
`topk` highest-scoring visible entries, or all of them when fewer exist. Unused slots are −1.
"""

from __future__ import annotations

import torch


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [T, H, d], weights [T, H], keys [N, d] -> scores [T, N] (float32)."""
    s = torch.einsum("thd,nd->thn", q.float(), keys.float()).relu_()
    return (s * weights.float().unsqueeze(-1)).sum(dim=1)


def causal_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [T, N], visible [T] -> indices [T, min(topk, N)] of the best visible entries, −1 padded."""
    n = scores.shape[-1]
    k = min(topk, n)
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    cols = torch.arange(n, device=scores.device)
    invisible = cols.unsqueeze(0) >= visible.unsqueeze(1)
    masked = scores.masked_fill(invisible, float("-inf"))
    idx = masked.topk(k, dim=-1).indices
    return torch.where(idx >= visible.unsqueeze(1), -1, idx)
