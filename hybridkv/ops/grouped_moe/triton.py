"""Triton kernel of the grouped MoE's last step: each token's routed-expert rows added in expert
order from zero in float32 (the per-expert loop's sums to the bit, as `reference.combine`), then an
optional addend (the shared expert's output) and the cast to the result dtype, in one launch
instead of a gather, a cast and an add per routing slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def combine_kernel(OUT, POS, PLUS, Y, D, K: tl.constexpr, HAS_PLUS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < D
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(POS + t * K + j).to(tl.int64)
        acc += tl.load(OUT + p * D + c, mask=ok, other=0.0).to(tl.float32)
    if HAS_PLUS:
        acc += tl.load(PLUS + t * D + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * D + c, acc.to(Y.dtype.element_ty), mask=ok)


def combine(out: torch.Tensor, pos: torch.Tensor, plus: torch.Tensor | None, result_dtype: torch.dtype) -> torch.Tensor:
    """out [P, D] sorted rows, pos [T, k] each token's rows in expert order -> [T, D] of result_dtype:
    Σ_j out[pos[t, j]] in float32, plus `plus` [T, D] when given."""
    t, k = pos.shape
    d = out.shape[-1]
    y = torch.empty(t, d, dtype=result_dtype, device=out.device)
    if t == 0:
        return y
    block = min(1024, triton.next_power_of_2(d))
    combine_kernel[(t, triton.cdiv(d, block))](out.contiguous(), pos.contiguous(),
                                               plus.contiguous() if plus is not None else out, y, d, K=k,
                                               HAS_PLUS=plus is not None, BLOCK=block, num_warps=4)
    return y
