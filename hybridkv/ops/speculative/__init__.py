"""The speculative step's greedy acceptance and its rollback of rejected positions
(engine/spec_graphs.py), one launch each:

- `accept_greedy`: how many positions each request keeps, and the tokens that follow them.

- `restore_states_`: every member of one compressor-state group set back to its state after the
  kept positions, from the copies the verify waves took (`kv`/`score` [n, slots, ...], copies
  [k, n, B, ...]: copy w holds the state after w + 1 kept positions; a request that kept all k + 1
  positions keeps its state as it is).
- `restore_ring_`: the window-ring rows that rejected positions overwrote put back.

On CUDA each is one Triton launch; elsewhere the plain-torch composition, which is the reference."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton


def restore_states_(kv: torch.Tensor, score: torch.Tensor, kv_copies: torch.Tensor, score_copies: torch.Tensor,
                    slots: torch.Tensor, kept: torch.Tensor) -> None:
    """kv, score [n, slots, ...] (contiguous, updated in place); kv_copies, score_copies [k, n, B, ...]
    of the same rows; slots [B] the requests' slots; kept [B] long in 1..k+1: for each request with
    kept[b] ≤ k, member m's state becomes copies[kept[b] − 1, m, b]."""
    k, n, b = kv_copies.shape[:3]
    for whole, copies in ((kv, kv_copies), (score, score_copies)):
        if whole.shape[0] != n or whole.shape[2:] != copies.shape[3:] or copies.shape[:3] != (k, n, b):
            raise ValueError(f"restore_states_: copies {tuple(copies.shape)} do not match states {tuple(whole.shape)}")
        if not (whole.is_contiguous() and copies.is_contiguous()):
            raise ValueError("restore_states_: states and copies must be contiguous")
    if not b:
        return
    if use_triton(kv):
        from hybridkv.ops.speculative import triton as kernels
        kernels.restore_states(kv, score, kv_copies, score_copies, slots, kept)
        return
    rows, pick = torch.arange(b, device=kept.device), (kept - 1).clamp(max=k - 1)
    restore = (kept <= k).view(1, b, *([1] * (kv.dim() - 2)))
    for whole, copies in ((kv, kv_copies), (score, score_copies)):
        whole[:, slots] = torch.where(restore, copies[pick, :, rows].transpose(0, 1), whole[:, slots])


def restore_ring_(rings: torch.Tensor, saved: torch.Tensor, slots: torch.Tensor, first: torch.Tensor,
                  kept: torch.Tensor) -> None:
    """rings [layers, slots, W, E] (contiguous, updated in place); saved [layers, B, k+1, E]: the rows
    positions first[b] + j held before the verify forward wrote them; kept [B] long: for j ≥ kept[b]
    ring row (first[b] + j) % W of slot slots[b] gets saved[:, b, j] back."""
    layers, b, k1 = saved.shape[:3]
    if rings.shape[0] != layers or rings.shape[3:] != saved.shape[3:] or rings.dtype != saved.dtype:
        raise ValueError(f"restore_ring_: saved rows {tuple(saved.shape)} {saved.dtype} do not match the rings "
                         f"{tuple(rings.shape)} {rings.dtype}")
    if not (rings.is_contiguous() and saved.is_contiguous()):
        raise ValueError("restore_ring_: rings and saved rows must be contiguous")
    if not b:
        return
    if use_triton(rings):
        from hybridkv.ops.speculative import triton as kernels
        kernels.restore_ring(rings, saved, slots, first, kept)
        return
    at = (first.unsqueeze(1) + torch.arange(k1, device=first.device)) % rings.shape[2]           # [B, k+1]
    now = rings[:, slots.unsqueeze(1), at]
    keep = (torch.arange(k1, device=kept.device) < kept.unsqueeze(1)).view(1, b, k1, *([1] * (rings.dim() - 3)))
    rings[:, slots.unsqueeze(1), at] = torch.where(keep, now, saved)


def accept_greedy(argmax: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """argmax [k+1, B] long: each verify row's argmax, wave after wave; tokens [B, k+1] long: each
    request's last token and its k drafts -> (kept [B] long: 1 + the drafts kept, while each equals
    the argmax of the row before it; following [B, k+1] long: the kept drafts, then the argmax
    after the last of them, repeated to the end)."""
    k1, b = argmax.shape
    if tokens.shape != (b, k1):
        raise ValueError(f"accept_greedy: tokens {tuple(tokens.shape)} for argmaxes {tuple(argmax.shape)}")
    if use_triton(argmax):
        from hybridkv.ops.speculative import triton as kernels
        return kernels.accept_greedy(argmax, tokens)
    drafts, rows = tokens[:, 1:], argmax.t()
    kept = (drafts == rows[:, :-1]).long().cumprod(1).sum(1) + 1
    at = (kept - 1).unsqueeze(1)
    own = rows.gather(1, at)
    column = torch.arange(k1, device=argmax.device).unsqueeze(0)
    return kept, torch.where(column < at, torch.cat([drafts, drafts[:, :1]], 1), own)
