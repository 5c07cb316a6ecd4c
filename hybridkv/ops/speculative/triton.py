"""Triton kernels of `restore_states_` and `restore_ring_` (a program per (row, piece of BLOCK
elements), which copies its piece where the request's kept count says the row goes back, and does
nothing elsewhere), and of `accept_greedy` (a program per request)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release

BLOCK = 1024


@triton.jit
def restore_states_kernel(KV, SCORE, KV_COPIES, SCORE_COPIES, SLOTS, KEPT, n_slots, K: tl.constexpr,
                          N: tl.constexpr, B, ROW, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    r = tl.program_id(0)                   # member m = r // B, request b = r % B
    m, b = r // B, r % B
    kept = tl.load(KEPT + b)
    if kept <= K:
        slot = tl.load(SLOTS + b).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < ROW
        dst = (m.to(tl.int64) * n_slots + slot) * ROW + c
        src = (((kept - 1).to(tl.int64) * N + m) * B + b) * ROW + c
        tl.store(KV + dst, tl.load(KV_COPIES + src, mask=ok), mask=ok)
        tl.store(SCORE + dst, tl.load(SCORE_COPIES + src, mask=ok), mask=ok)


def restore_states(kv: torch.Tensor, score: torch.Tensor, kv_copies: torch.Tensor, score_copies: torch.Tensor,
                   slots: torch.Tensor, kept: torch.Tensor) -> None:
    k, n, b = kv_copies.shape[:3]
    row = kv[0, 0].numel()
    grid = (n * b, triton.cdiv(row, BLOCK))
    restore_states_kernel[grid](kv, score, kv_copies, score_copies, slots, kept, kv.shape[1], K=k, N=n, B=b,
                                ROW=row, BLOCK=BLOCK, num_warps=4, **triton_args(kv))


@triton.jit
def restore_ring_kernel(RINGS, SAVED, SLOTS, FIRST, KEPT, n_slots, W, B, K1: tl.constexpr, ROW,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    r = tl.program_id(0)                   # layer l, request b, verify position j
    j = r % K1
    b = (r // K1) % B
    layer = r // (K1 * B)
    if j >= tl.load(KEPT + b):
        slot = tl.load(SLOTS + b).to(tl.int64)
        at = (tl.load(FIRST + b).to(tl.int64) + j) % W
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < ROW
        dst = ((layer.to(tl.int64) * n_slots + slot) * W + at) * ROW + c
        tl.store(RINGS + dst, tl.load(SAVED + r.to(tl.int64) * ROW + c, mask=ok), mask=ok)


def restore_ring(rings: torch.Tensor, saved: torch.Tensor, slots: torch.Tensor, first: torch.Tensor,
                 kept: torch.Tensor) -> None:
    layers, b, k1, row = saved.shape
    grid = (layers * b * k1, triton.cdiv(row, BLOCK))
    restore_ring_kernel[grid](rings, saved, slots, first, kept, rings.shape[1], rings.shape[2], b, K1=k1, ROW=row,
                              BLOCK=BLOCK, num_warps=4, **triton_args(rings))


@triton.jit
def accept_greedy_kernel(ARGMAX, TOKENS, s_tok, KEPT, FOLLOWING, B, K1: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    wait_then_release(PDL)
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    is_draft = (i >= 1) & (i < K1)
    draft = tl.load(TOKENS + b.to(tl.int64) * s_tok + i, mask=is_draft, other=-1)
    before = tl.load(ARGMAX + (i - 1) * B + b, mask=is_draft, other=-2)       # the argmax of the row before
    # drafts kept: those before the first disagreement
    wrong = tl.cumsum((is_draft & (draft != before)).to(tl.int32), 0)
    kept = tl.sum((is_draft & (wrong == 0)).to(tl.int32), 0) + 1
    own = tl.load(ARGMAX + (kept - 1) * B + b)
    nxt = tl.load(TOKENS + b.to(tl.int64) * s_tok + i + 1, mask=i + 1 < K1, other=0)   # draft i + 1
    tl.store(KEPT + b, kept.to(tl.int64))
    tl.store(FOLLOWING + b.to(tl.int64) * K1 + i, tl.where(i < kept - 1, nxt, own), mask=i < K1)


def accept_greedy(argmax: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    k1, b = argmax.shape
    argmax = argmax.contiguous()
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    kept = torch.empty(b, dtype=torch.long, device=argmax.device)
    following = torch.empty(b, k1, dtype=torch.long, device=argmax.device)
    if b:
        accept_greedy_kernel[(b,)](argmax, tokens, tokens.stride(0), kept, following, b, K1=k1,
                                   BLOCK=triton.next_power_of_2(k1 + 1), num_warps=1, **triton_args(argmax))
    return kept, following
