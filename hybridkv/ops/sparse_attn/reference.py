"""Sparse attention with a per-head sink over an index list (MQA: one shared K = V row per entry).

    o_h(t) = Σ_{j ∈ idx[t]} e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink_h}),   s_j = q_h(t) · kv_j · scale

i.e. a softmax over the selected logits plus the sink logit, whose value row is zero. Indices equal
to −1 are skipped.
"""

from __future__ import annotations

import torch

# Queries per gather tile: bounds the [tile, K, D] gathered copy of the KV rows.
_TILE_ELEMS = 1 << 25


def _attend(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    rows = kv[idx.clamp(min=0)].float()                       # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(s - m)
    p = p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))
    return torch.einsum("thk,tkd->thd", p, rows)


def sparse_attn(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], kv [N, D], idx [T, K] (int, −1 = none), sink [H] -> o [T, H, D] (float32)."""
    t, k = idx.shape
    tile = max(1, _TILE_ELEMS // max(1, k * kv.shape[-1]))
    if t <= tile:
        return _attend(q, kv, idx, sink, scale)
    return torch.cat([_attend(q[i:i + tile], kv, idx[i:i + tile], sink, scale) for i in range(0, t, tile)])
