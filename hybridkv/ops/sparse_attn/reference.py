"""Sparse attention with a per-head sink over an index list (MQA: one shared K = V row per entry).

    o_h(t) = Σ_{j ∈ idx[t]} e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink_h}),   s_j = q_h(t) · kv_j · scale

i.e. a softmax over the selected logits plus the sink logit, whose value row is zero. Indices equal
to −1 are skipped.
"""

from __future__ import annotations

import torch

from hybridkv.ops.kv_formats import unpack_main_fp8, unpack_v41_global, unpack_v41_window
from hybridkv.ops.paged import entry_rows

# Queries per gather tile: bounds the [tile, K, D] gathered copy of the KV rows. On the CPU a tile
# that stays in cache (4 MiB) is the faster one (docs/training-log.md, 2026-12-06); elsewhere
# fewer, larger tiles mean fewer launches.
def _tile_elements(device: torch.device) -> int:
    return 1 << 20 if device.type == "cpu" else 1 << 25


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
    tile = max(1, _tile_elements(kv.device) // max(1, k * kv.shape[-1]))
    if t <= tile:
        return _attend(q, kv, idx, sink, scale)
    return torch.cat([_attend(q[i:i + tile], kv, idx[i:i + tile], sink, scale) for i in range(0, t, tile)])


def attention_probs(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """The weights `sparse_attn` gives each listed row: [T, H, K] (0 for idx −1; the sink's share is
    the rest of each row's mass)."""
    rows = kv[idx.clamp(min=0)].float()
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
    sink = sink.float().view(1, -1, 1)
    m = torch.maximum(s.amax(dim=-1, keepdim=True), sink)
    p = torch.exp(s - m)
    return p / (p.sum(-1, keepdim=True) + torch.exp(sink - m))


def decode_entries(x: torch.Tensor, fmt: str, head_dim: int, rope_dim: int, pool: bool = False) -> torch.Tensor:
    """Pool/ring/new rows in entry format `fmt` -> float32 [rows, head_dim]. "v41" rows are window
    rows (ring, new), or global KV entries where `pool`."""
    flat = x.reshape(-1, x.shape[-1])
    if fmt == "fp8":
        return unpack_main_fp8(flat, head_dim, rope_dim)
    if fmt == "v41":
        return (unpack_v41_global if pool else unpack_v41_window)(flat, head_dim)
    return flat.float()


def gather_paged(batch, new_kv, ring, pool, idx=None, ratio=0, fmt="bf16", head_dim=None, rope_dim=0,
                 window=128) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows a paged batch attends to, as (rows [M, D] float32, index [T, window + K]) for
    `sparse_attn`: token t's window positions [t − window + 1, t] oldest first (−1 before position 0),
    then its compressed entries (CSA: `idx[t]`; HCA: every j < (t+1)//ratio)."""
    dev = batch.positions.device
    parts = [decode_entries(new_kv, fmt, head_dim, rope_dim)]
    off_ring = parts[0].shape[0]
    if ring is not None:
        parts.append(decode_entries(ring, fmt, head_dim, rope_dim))
    off_pool = sum(p.shape[0] for p in parts)
    if pool is not None:
        parts.append(decode_entries(pool, fmt, head_dim, rope_dim, pool=True))
    rows = torch.cat(parts)
    pos = batch.positions.long()
    req = batch.token_req.long()
    start, row0 = batch.seg_start.long()[req], batch.seg_row0.long()[req]
    p = pos.unsqueeze(1) - window + 1 + torch.arange(window, device=dev)
    new_row = row0.unsqueeze(1) + p - start.unsqueeze(1)
    ring_row = off_ring + batch.slots.long()[req].unsqueeze(1) * window + p.clamp(min=0) % window
    win = torch.where(p >= start.unsqueeze(1), new_row, ring_row)
    cols = [torch.where(p >= 0, win, -1)]
    if idx is not None or ratio:
        per_block = batch.block_tokens // ratio
        if idx is None:
            n = int((pos.max() + 1) // ratio) if pos.numel() else 0
            j = torch.arange(n, device=dev).expand(pos.shape[0], n)
            idx = torch.where(j < ((pos + 1) // ratio).unsqueeze(1), j, -1)
        r = entry_rows(batch, req.unsqueeze(1).expand_as(idx), idx, per_block)
        cols.append(torch.where(r >= 0, r + off_pool, -1))
    return rows, torch.cat(cols, dim=1)
