"""Triton kernels for mHC: a program per token and column chunk.

`pre_kernel`: the mixes' normalisation (the sum of squares of the hc·dim stream row), the σ / 2σ
gates, the row softmax and the Sinkhorn iterations on the hc×hc combination, then y = Σ_j pre_j x_j
over its columns (the chunk-0 program stores post and comb). The raw mixes come either computed
(`mixes_raw`, a GEMM the caller ran) or as `mix_partials`' per-chunk partial sums, which the
program adds up itself: the mixes and the sum of squares in one launch that reads each stream row
once, instead of a GEMM of a float32 copy and a pass per program over the row
(`mix_partials_kernel` at decode sizes, `mixes_kernel` on the tensor cores for prefill).
V4.1's single-pass mHC (`GIVEN_PRE`) collapses the stream with the pre mix the previous sub-block
computed instead of its own, and stores its own for the next one (`mhc_mixes_collapse`).
`post_kernel`: x'_k = post_k · f + Σ_j comb[j, k] x_j over its columns. With few tokens (decode)
the row's columns are split over programs so that the step's mHC is not a handful of SMs streaming
a whole row each; every chunk's program repeats the (small, L2-resident) Sinkhorn, identically.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import interpreting
from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release

MIX_CHUNK = 256             # flat stream columns per `mix_partials_kernel` program
MIX_TOKENS = 8              # tokens per `mix_partials_kernel` program beyond MIX_ONE_TOKEN tokens
MIX_ONE_TOKEN = 16          # up to here a program per token and chunk (the fn chunk re-read from L2)
MAX_PARTIAL_TOKENS = 64     # more tokens (prefill): the mixes from `mixes_kernel`
PRE_WARPS = 1               # warps of a `pre_kernel` program (H200, 8192 bf16 rows: 0.09 ms at 1, 0.35 at 2, 1.2 at 4)


@triton.jit
def mix_partials_kernel(X, sx_t, FN, PART, T, K, NCH, M, CH: tl.constexpr, MP: tl.constexpr, TB: tl.constexpr,
                        PDL: tl.constexpr):
    """For TB tokens and one chunk of CH flat columns: PART[t, ch, m] = Σ_c fn[m, c] · x[t, c] for
    m < M, and PART[t, ch, M] = Σ_c x[t, c]², in float32 (x read as stored)."""
    wait_then_release(PDL)
    ch = tl.program_id(0)
    t0 = tl.program_id(1) * TB
    c = ch * CH + tl.arange(0, CH)
    c_ok = c < K
    m = tl.arange(0, MP)
    w = tl.load(FN + m[:, None] * K + c[None, :], mask=(m < M)[:, None] & c_ok[None, :], other=0.0)
    for i in range(TB):
        t = t0 + i
        if t < T:
            v = tl.load(X + t.to(tl.int64) * sx_t + c, mask=c_ok, other=0.0).to(tl.float32)
            part = tl.sum(w * v[None, :], 1)
            part = tl.where(m == M, tl.sum(v * v, 0), part)
            tl.store(PART + (t.to(tl.int64) * NCH + ch) * MP + m, part, mask=m <= M)


@triton.jit
def pre_kernel(X, sx_t, MIX, SCALE, BASE, Y, POST, COMB, PRE_IN, PRE_OUT, DIM, CHUNK, NCH, iters, eps, norm_eps,
               HC: tl.constexpr, BLOCK: tl.constexpr, PARTIALS: tl.constexpr, MP: tl.constexpr,
               NCHP: tl.constexpr, GIVEN_PRE: tl.constexpr, HEAD: tl.constexpr, PDL: tl.constexpr):
    """MIX: the raw mixes [T, (2+hc)·hc], or with PARTIALS `mix_partials`' [T, NCH, MP]. GIVEN_PRE:
    y = Σ_j PRE_IN[t, j] x_j, and this site's pre is stored in PRE_OUT [T, hc]. HEAD (with
    PARTIALS): the collapse before the LM head, whose mixes are the hc pre mixes alone: y only."""
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK
    j = tl.arange(0, HC)
    k2 = j[:, None] * HC + j[None, :]
    xrow = X + t * sx_t
    if PARTIALS:
        # the chunks' partial sums added in one fixed order (whatever the batch)
        M: tl.constexpr = HC if HEAD else (2 + HC) * HC
        q = tl.arange(0, NCHP)
        q_ok = q < NCH
        part = MIX + t * NCH * MP + q * MP
        ss_total = tl.sum(tl.load(part + M, mask=q_ok, other=0.0), 0)
        pre_raw = tl.sum(tl.load(part[:, None] + j[None, :], mask=q_ok[:, None], other=0.0), 0)
        if not HEAD:
            post_raw = tl.sum(tl.load(part[:, None] + HC + j[None, :], mask=q_ok[:, None], other=0.0), 0)
            comb_raw = tl.sum(tl.load(part[:, None, None] + 2 * HC + k2[None, :, :], mask=q_ok[:, None, None],
                                      other=0.0), 0)
    else:
        ss = tl.zeros([HC, BLOCK], tl.float32)
        for c0 in range(0, DIM, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            v = tl.load(xrow + j[:, None] * DIM + c[None, :], mask=(c < DIM)[None, :], other=0.0).to(tl.float32)
            ss += v * v
        ss_total = tl.sum(tl.sum(ss, 1), 0)
        mix = MIX + t * (2 + HC) * HC
        pre_raw = tl.load(mix + j)
        post_raw = tl.load(mix + HC + j)
        comb_raw = tl.load(mix + 2 * HC + k2)
    rs = tl.rsqrt(ss_total / (HC * DIM) + norm_eps)
    pre = tl.sigmoid(pre_raw * rs * tl.load(SCALE) + tl.load(BASE + j)) + eps
    if not HEAD:
        post = 2 * tl.sigmoid(post_raw * rs * tl.load(SCALE + 1) + tl.load(BASE + HC + j))
        cm = comb_raw * rs * tl.load(SCALE + 2) + tl.load(BASE + 2 * HC + k2)
        cm = tl.exp(cm - tl.max(cm, 1)[:, None])
        cm = cm / tl.sum(cm, 1)[:, None] + eps
        cm = cm / (tl.sum(cm, 0)[None, :] + eps)
        for _ in range(1, iters):
            cm = cm / (tl.sum(cm, 1)[:, None] + eps)
            cm = cm / (tl.sum(cm, 0)[None, :] + eps)
        if first == 0:
            tl.store(POST + t * HC + j, post)
            tl.store(COMB + t * HC * HC + k2, cm)
            if GIVEN_PRE:
                tl.store(PRE_OUT + t * HC + j, pre)
    if GIVEN_PRE:
        pre = tl.load(PRE_IN + t * HC + j)
    last = tl.minimum(first + CHUNK, DIM)
    for c0 in range(first, last, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        v = tl.load(xrow + j[:, None] * DIM + c[None, :], mask=(c < last)[None, :], other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * v, 0)
        tl.store(Y + t * DIM + c, y.to(Y.dtype.element_ty), mask=c < last)


@triton.jit
def mixes_kernel(X, sx_t, FN, PART, T, K, KS, NCH, M, BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr,
                 PIECES: tl.constexpr, PREC: tl.constexpr, F32_DOT: tl.constexpr):
    """BT tokens and the KS flat columns of split s = program_id(1): PART[t, s, m] = Σ_c fn[m, c]·x[t, c]
    (m < M) and PART[t, s, M] = Σ_c x[t, c]², float32, x read as stored. With PIECES (a 16-bit
    stream), FN holds fn as three bfloat16 pieces [3, MP, K] whose sum is fn to float32's precision:
    three bf16 MMAs whose products are exact in float32 give float32's GEMM. Else (a float32 stream)
    FN is fn [M, K] in float32 on tf32x3 MMAs (PREC). F32_DOT: the pieces' products in float32 (the
    interpreter, whose dot takes no bfloat16)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    t_ok = t < T
    s = tl.program_id(1)
    m = tl.arange(0, MP)
    acc = tl.zeros([BT, MP], tl.float32)
    ss = tl.zeros([BT, BK], tl.float32)
    last = tl.minimum(s * KS + KS, K)
    for k0 in range(s * KS, last, BK):
        c = k0 + tl.arange(0, BK)
        c_ok = c < last
        x = tl.load(X + t.to(tl.int64)[:, None] * sx_t + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
        xf = x.to(tl.float32)
        ss += xf * xf
        if PIECES:
            w_at = FN + m[:, None] * K + c[None, :]
            for i in tl.static_range(3):
                w = tl.load(w_at + i * MP * K, mask=c_ok[None, :], other=0.0)
                if F32_DOT:
                    acc = tl.dot(xf, tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
        else:
            w = tl.load(FN + m[:, None] * K + c[None, :], mask=(m < M)[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(xf, tl.trans(w), acc, input_precision=PREC)
    acc = tl.where(m[None, :] == M, tl.sum(ss, 1)[:, None], acc)
    out = PART + (t.to(tl.int64)[:, None] * NCH + s) * MP + m[None, :]
    tl.store(out, acc, mask=t_ok[:, None] & (m <= M)[None, :])


@triton.jit
def post_kernel(F, R, POST, COMB, OUT, DIM, CHUNK, HC: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_then_release(PDL)
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * CHUNK
    last = tl.minimum(first + CHUNK, DIM)
    j = tl.arange(0, HC)
    post = tl.load(POST + t * HC + j)
    cm = tl.load(COMB + t * HC * HC + j[:, None] * HC + j[None, :])          # [j, k]
    for c0 in range(first, last, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        cmask = (c < last)[None, :]
        f = tl.load(F + t * DIM + c, mask=c < last, other=0.0).to(tl.float32)
        acc = post[:, None] * f[None, :]
        for jj in tl.static_range(HC):
            xj = tl.load(R + t * HC * DIM + jj * DIM + c, mask=c < last, other=0.0).to(tl.float32)
            wj = tl.sum(tl.where(j[:, None] == jj, cm, 0.0), 0)                 # comb[jj, :]
            acc += wj[:, None] * xj[None, :]
        tl.store(OUT + t * HC * DIM + j[:, None] * DIM + c[None, :], acc.to(OUT.dtype.element_ty), mask=cmask)


NUM_SMS_GUESS = 132     # H200; only sizes the column split
SPLIT_BLOCK = 256       # columns per step when a row is split over programs


def column_split(t: int, dim: int) -> tuple[int, int, int]:
    """(BLOCK, CHUNK, number of chunks) for t tokens of dim columns: one program per token once the
    tokens alone cover every SM twice, else each row cut into chunks of whole BLOCKs. BLOCK depends
    on dim alone, so that the sum of squares adds in the same order whatever the batch."""
    block = min(SPLIT_BLOCK, triton.next_power_of_2(dim))
    blocks = triton.cdiv(dim, block)
    chunks = max(1, min(blocks, (2 * NUM_SMS_GUESS) // max(t, 1)))
    chunk = triton.cdiv(blocks, chunks) * block
    return block, chunk, triton.cdiv(dim, chunk)


def mix_partials(x2: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """x2 [T, K] (rows contiguous, any float dtype), fn [M, K] float32 -> [T, chunks, MP] float32:
    per chunk of columns the M partial mixes, then the partial sum of squares at M, in one pass over
    x2 as stored. Up to `MAX_PARTIAL_TOKENS` tokens (decode) `mix_partials_kernel`'s chunks of
    `MIX_CHUNK` columns; beyond (prefill) `mixes_kernel` on the tensor cores in `MIXES_SPLIT`-column
    splits. Either way a token's sums do not depend on the other tokens of the launch."""
    t, k = x2.shape
    m = fn.shape[0]
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    fn = fn.float().contiguous()
    mp = triton.next_power_of_2(m + 1)
    if t > MAX_PARTIAL_TOKENS:
        return _prefill_partials(x2, fn, mp)
    nch = triton.cdiv(k, MIX_CHUNK)
    part = torch.empty(t, nch, mp, dtype=torch.float32, device=x2.device)
    if t:
        # a token's partials do not depend on how many tokens share its program
        tb = 1 if t <= MIX_ONE_TOKEN else MIX_TOKENS
        mix_partials_kernel[(nch, triton.cdiv(t, tb))](x2, x2.stride(0), fn, part, t, k, nch, m, CH=MIX_CHUNK, MP=mp,
                                                       TB=tb, num_warps=4, **triton_args(x2))
    return part


MIXES_TOKENS = 64           # tokens per `mixes_kernel` program
MIXES_K = 64                # flat columns per step of its K loop
MIXES_SPLIT = 2048          # flat columns per program (a multiple of MIXES_K)


def bf16_pieces(fn: torch.Tensor, mp: int) -> torch.Tensor:
    """fn [M, K] float32 -> [3, mp, K] bfloat16 (rows past M zero) whose sum is fn to within float32's
    rounding: each piece holds the next 8 bits of every value's significand."""
    pieces = torch.zeros(3, mp, fn.shape[1], dtype=torch.bfloat16, device=fn.device)
    rest = fn
    for i in range(3):
        pieces[i, : fn.shape[0]] = rest
        rest = rest - pieces[i, : fn.shape[0]].float()
    return pieces


def _prefill_partials(x2: torch.Tensor, fn: torch.Tensor, mp: int) -> torch.Tensor:
    """`mixes_kernel` over MIXES_SPLIT-column splits of K: a token's partial sums depend on K alone,
    not on how many tokens share the launch (at V4-Flash's width 8 splits, and 8192 tokens 1,024
    programs)."""
    t, k = x2.shape
    nch = triton.cdiv(k, MIXES_SPLIT)
    part = torch.empty(t, nch, mp, dtype=torch.float32, device=x2.device)
    pieces = x2.dtype == torch.bfloat16
    w = bf16_pieces(fn, mp) if pieces else fn
    prec = "ieee" if interpreting() else "tf32x3"
    mixes_kernel[(triton.cdiv(t, MIXES_TOKENS), nch)](x2, x2.stride(0), w, part, t, k, MIXES_SPLIT, nch, fn.shape[0],
                                                      BT=MIXES_TOKENS, BK=MIXES_K, MP=mp, PIECES=pieces, PREC=prec,
                                                      F32_DOT=interpreting(), num_warps=4, num_stages=3)
    return part


def raw_mixes(x2: torch.Tensor, fn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x2 · fnᵀ [T, M], Σ x2² [T]) in float32: `mix_partials`' chunks added in order."""
    part = mix_partials(x2, fn)
    m = fn.shape[0]
    total = part[:, :, : m + 1].sum(1)
    return total[:, :m], total[:, m]


def mhc_pre(x, mixes_raw, scale, base, iters, eps, norm_eps):
    """`reference.mhc_pre` with the raw mixes [T, (2+hc)·hc] given (a GEMM the caller ran)."""
    return _pre(x, mixes_raw, False, scale, base, iters, eps, norm_eps)


def mhc_pre_fn(x, fn, scale, base, iters, eps, norm_eps):
    """`reference.mhc_pre` with the raw mixes flat(x) · fnᵀ computed here, in two launches:
    `mix_partials` (the mixes and the sum of squares in one pass over the stream), then `pre_kernel`
    adding its partial sums."""
    return _pre(x, mix_partials(x.flatten(1), fn), True, scale, base, iters, eps, norm_eps)


def mhc_mixes_collapse(x, prev_pre, fn, scale, base, iters, eps, norm_eps):
    """V4.1's single-pass site: (Σ_j prev_pre_j x_j [T, dim], and this site's pre [T, hc], post,
    comb from flat(x) · fnᵀ), in the two launches of `mhc_pre_fn`."""
    pre = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    y, post, comb = _pre(x, mix_partials(x.flatten(1), fn), True, scale, base, iters, eps, norm_eps,
                         given=(prev_pre.float().contiguous(), pre))
    return y, pre, post, comb


def mhc_head(x, fn, scale, base, eps, norm_eps):
    """`reference`'s collapse before the LM head, σ(mixes · scale + base) + eps weighting the copies
    (no Sinkhorn), in the two launches of `mhc_pre_fn`: x [T, hc, dim] -> [T, dim] in x's dtype."""
    return _pre(x, mix_partials(x.flatten(1), fn), True, scale, base, 0, eps, norm_eps, head=True)[0]


def _pre(x, mixes, partials, scale, base, iters, eps, norm_eps, given=None, head=False):
    t, hc, dim = x.shape
    x = x.contiguous()
    y = torch.empty(t, dim, dtype=x.dtype, device=x.device)
    post = torch.empty(t, hc, dtype=torch.float32, device=x.device)
    comb = torch.empty(t, hc, hc, dtype=torch.float32, device=x.device)
    if t:
        block, chunk, chunks = column_split(t, dim)
        nch, mp = (mixes.shape[1], mixes.shape[2]) if partials else (1, 1)
        mixes = mixes if partials else mixes.float().contiguous()
        pre_in, pre_out = given if given is not None else (post, post)   # (not read or written then)
        pre_kernel[(t, chunks)](x, x.stride(0), mixes, scale.float().contiguous(), base.float().contiguous(), y,
                                post, comb, pre_in, pre_out, dim, chunk, nch, iters, eps, norm_eps, HC=hc,
                                BLOCK=block, PARTIALS=partials, MP=mp, NCHP=triton.next_power_of_2(nch),
                                GIVEN_PRE=given is not None, HEAD=head, num_warps=PRE_WARPS, **triton_args(x))
    return y, post, comb


def mhc_post(f, residual, post, comb, out=None):
    """`out` may be the residual itself (each program reads a token's copies before writing them)."""
    t, hc, dim = residual.shape
    out = torch.empty(t, hc, dim, dtype=f.dtype, device=f.device) if out is None else out
    if t:
        block, chunk, chunks = column_split(t, dim)
        post_kernel[(t, chunks)](f.contiguous(), residual.contiguous(), post.float().contiguous(),
                                 comb.float().contiguous(), out, dim, chunk, HC=hc, BLOCK=block, num_warps=4,
                                 **triton_args(f))
    return out
