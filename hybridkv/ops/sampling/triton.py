"""Greedy rows in two launches: `partials_kernel` (a program per row and chunk of CHUNK logits: the
chunk's maximum, its first index, and Σ exp(x − maximum)), then `finish_kernel` (a program per row:
the row's maximum, the first index holding it — the lowest chunk's, since chunks are in order —
and the log-probability −log Σ_chunks sum · exp(chunk maximum − maximum))."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 2048


@triton.jit
def partials_kernel(X, stride_x, V, PM, PI, PS, NCH, CH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1)
    c = ch * CH + tl.arange(0, CH)
    x = tl.load(X + b * stride_x + c, mask=c < V, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    i = tl.argmax(x, 0, tie_break_left=True)
    s = tl.sum(tl.exp(x - m), 0)
    at = b * NCH + ch
    tl.store(PM + at, m)
    tl.store(PI + at, (ch * CH + i).to(tl.int64))
    tl.store(PS + at, s)


@triton.jit
def finish_kernel(PM, PI, PS, NCH, TOK, LOGP, NCHP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    q = tl.arange(0, NCHP)
    ok = q < NCH
    pm = tl.load(PM + b * NCH + q, mask=ok, other=float("-inf"))
    m = tl.max(pm, 0)
    first = tl.min(tl.where(ok & (pm == m), q, NCHP), 0)
    tok = tl.sum(tl.where(q == first, tl.load(PI + b * NCH + q, mask=ok, other=0), 0), 0)
    s = tl.sum(tl.where(ok, tl.load(PS + b * NCH + q, mask=ok, other=0.0) * tl.exp(pm - m), 0.0), 0)
    tl.store(TOK + b, tok)
    tl.store(LOGP + b, -tl.log(s))


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] (last dim contiguous) -> (argmax int64 [B], log-softmax at it float32 [B])."""
    b, v = logits.shape
    nch = triton.cdiv(v, CHUNK)
    dev = logits.device
    pm = torch.empty(b, nch, dtype=torch.float32, device=dev)
    pi = torch.empty(b, nch, dtype=torch.int64, device=dev)
    ps = torch.empty(b, nch, dtype=torch.float32, device=dev)
    tok = torch.empty(b, dtype=torch.int64, device=dev)
    logp = torch.empty(b, dtype=torch.float32, device=dev)
    partials_kernel[(b, nch)](logits, logits.stride(0), v, pm, pi, ps, nch, CH=CHUNK, num_warps=4)
    finish_kernel[(b,)](pm, pi, ps, nch, tok, logp, NCHP=triton.next_power_of_2(nch), num_warps=1)
    return tok, logp
