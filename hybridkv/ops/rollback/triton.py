"""Triton kernels of `restore_states_` and `restore_ring_`: a program per (row, piece of BLOCK
elements), which copies its piece where the request's kept count says the row goes back, and does
nothing elsewhere."""

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
