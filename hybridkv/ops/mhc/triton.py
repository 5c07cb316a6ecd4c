"""Triton kernels for mHC: one program per token.

`pre_kernel`: sum of squares of the hc·dim stream row, the mixes' normalisation, the σ / 2σ gates,
the row softmax and the Sinkhorn iterations on the hc×hc combination, then y = Σ_j pre_j x_j.
`post_kernel`: x'_k = post_k · f + Σ_j comb[j, k] x_j in one pass over the row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def pre_kernel(X, sx_t, MIX, SCALE, BASE, Y, POST, COMB, DIM, iters, eps, norm_eps,
               HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HC)
    xrow = X + t * sx_t
    ss = tl.zeros([HC, BLOCK], tl.float32)
    for c0 in range(0, DIM, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(xrow + j[:, None] * DIM + c[None, :], mask=(c < DIM)[None, :], other=0.0).to(tl.float32)
        ss += v * v
    rs = tl.rsqrt(tl.sum(tl.sum(ss, 1), 0) / (HC * DIM) + norm_eps)
    mix = MIX + t * (2 + HC) * HC
    pre = tl.sigmoid(tl.load(mix + j) * rs * tl.load(SCALE) + tl.load(BASE + j)) + eps
    post = 2 * tl.sigmoid(tl.load(mix + HC + j) * rs * tl.load(SCALE + 1) + tl.load(BASE + HC + j))
    k2 = j[:, None] * HC + j[None, :]
    cm = tl.load(mix + 2 * HC + k2) * rs * tl.load(SCALE + 2) + tl.load(BASE + 2 * HC + k2)
    cm = tl.exp(cm - tl.max(cm, 1)[:, None])
    cm = cm / tl.sum(cm, 1)[:, None] + eps
    cm = cm / (tl.sum(cm, 0)[None, :] + eps)
    for _ in range(1, iters):
        cm = cm / (tl.sum(cm, 1)[:, None] + eps)
        cm = cm / (tl.sum(cm, 0)[None, :] + eps)
    tl.store(POST + t * HC + j, post)
    tl.store(COMB + t * HC * HC + k2, cm)
    for c0 in range(0, DIM, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(xrow + j[:, None] * DIM + c[None, :], mask=(c < DIM)[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * v, 0)
        tl.store(Y + t * DIM + c, y.to(Y.dtype.element_ty), mask=c < DIM)


@triton.jit
def post_kernel(F, R, POST, COMB, OUT, DIM, HC: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HC)
    post = tl.load(POST + t * HC + j)
    cm = tl.load(COMB + t * HC * HC + j[:, None] * HC + j[None, :])          # [j, k]
    for c0 in range(0, DIM, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cmask = (c < DIM)[None, :]
        f = tl.load(F + t * DIM + c, mask=c < DIM, other=0.0).to(tl.float32)
        acc = post[:, None] * f[None, :]
        for jj in tl.static_range(HC):
            xj = tl.load(R + t * HC * DIM + jj * DIM + c, mask=c < DIM, other=0.0).to(tl.float32)
            wj = tl.sum(tl.where(j[:, None] == jj, cm, 0.0), 0)                 # comb[jj, :]
            acc += wj[:, None] * xj[None, :]
        tl.store(OUT + t * HC * DIM + j[:, None] * DIM + c[None, :], acc.to(OUT.dtype.element_ty), mask=cmask)


def mhc_pre(x, mixes_raw, scale, base, iters, eps, norm_eps):
    t, hc, dim = x.shape
    x = x.contiguous()
    y = torch.empty(t, dim, dtype=x.dtype, device=x.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=x.device)
    if t:
        pre_kernel[(t,)](x, x.stride(0), mixes_raw.float().contiguous(), scale.float().contiguous(),
                         base.float().contiguous(), y, post, comb, dim, iters, eps, norm_eps, HC=hc,
                         BLOCK=min(1024, triton.next_power_of_2(dim)), num_warps=4)
    return y, post, comb


def mhc_post(f, residual, post, comb):
    t, hc, dim = residual.shape
    out = torch.empty(t, hc, dim, dtype=f.dtype, device=f.device)
    if t:
        post_kernel[(t,)](f.contiguous(), residual.contiguous(), post.float().contiguous(), comb.float().contiguous(),
                          out, dim, HC=hc, BLOCK=min(1024, triton.next_power_of_2(dim)), num_warps=4)
    return out
