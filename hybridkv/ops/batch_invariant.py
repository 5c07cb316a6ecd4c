"""Batch-invariant replacements for the torch ops whose CUDA kernels change their reduction order
with the number of rows (cuBLAS picks tiles and split-K by shape; reductions split a row over
more threads when there are few rows). With `enable(True)` the CUDA implementations of
`aten::mm`, `aten::addmm`, `aten::bmm` and `aten::mean.dim` are replaced by Triton kernels whose
per-row arithmetic is fixed: one tile shape, no split-K, K walked in order; one program per row.
A row's result is then the same bits whatever else is in the batch. Slower than cuBLAS; meant for
the deterministic mode only (`hybridkv.ops.backend.set_deterministic`).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_LIB: torch.library.Library | None = None


@triton.jit
def _mm_kernel(A, B, C, M, N, K, sam, sak, sbk, sbn, scm, scn, sab, sbb, scb, BM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, PREC: tl.constexpr, ELEMENTWISE: tl.constexpr = False):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)       # bmm: one matrix product per batch index
    A += batch * sab
    B += batch * sbb
    C += batch * scb
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(A + rm[:, None].to(tl.int64) * sam + (k0 + rk)[None, :] * sak,
                    mask=(rm[:, None] < M) & ((k0 + rk)[None, :] < K), other=0.0)
        b = tl.load(B + (k0 + rk)[:, None].to(tl.int64) * sbk + rn[None, :] * sbn,
                    mask=((k0 + rk)[:, None] < K) & (rn[None, :] < N), other=0.0)
        if ELEMENTWISE:
            # Triton's interpreter hands tl.dot to the host BLAS, whose vector kernels round a row by
            # its place in the tile (AVX-512 builds): the products summed over K instead
            acc += tl.sum(a[:, :, None] * b[None, :, :], 1)
        else:
            acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(C + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _row_mean_kernel(X, Y, N, sx, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, N, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        acc += tl.load(X + r * sx + c, mask=c < N, other=0.0).to(tl.float32)
    tl.store(Y + r, tl.sum(acc, 0) / N)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N], or batched a [G, M, K] @ b [G, K, N] in one launch (each product's
    elements computed exactly as a 2-D product of the same rows computes them)."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    g, m, k = a3.shape
    n = b3.shape[2]
    c = torch.empty(g, m, n, dtype=out_dtype or a.dtype, device=a.device)
    out = c if batched else c[0]
    if g == 0 or m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    f32 = a.dtype == torch.float32 or b.dtype == torch.float32
    if a.dtype != b.dtype:
        a3, b3 = a3.float(), b3.float()
    bm, bn, bk = (64, 64, 32) if f32 else (128, 128, 64)
    _mm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), g)](
        a3, b3, c, m, n, k, a3.stride(1), a3.stride(2), b3.stride(1), b3.stride(2), c.stride(1), c.stride(2),
        a3.stride(0), b3.stride(0), c.stride(0), BM=bm, BN=bn, BK=bk, PREC="ieee" if f32 else "tf32",
        ELEMENTWISE=os.environ.get("TRITON_INTERPRET", "0") == "1", num_warps=4 if f32 else 8)
    return out


def _addmm(bias, a, b, *, beta=1, alpha=1):
    out = mm(a, b, torch.float32)
    if alpha != 1:
        out = out * alpha
    if beta != 0:
        out = out + beta * bias.float()
    return out.to(a.dtype)


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    dims = [d % x.dim() for d in (dim if dim is not None else range(x.dim()))]
    if dims != [x.dim() - 1] or not x.is_floating_point():
        n = 1
        for d in dims:
            n *= x.shape[d]
        return (torch.sum(x, dims, keepdim=keepdim, dtype=dtype or (torch.float32 if x.dtype != torch.float64
                                                                    else None)) / n).to(dtype or x.dtype)
    xc = x.contiguous().view(-1, x.shape[-1])
    y = torch.empty(xc.shape[0], dtype=torch.float32, device=x.device)
    if xc.shape[0]:
        _row_mean_kernel[(xc.shape[0],)](xc, y, xc.shape[1], xc.stride(0), BLOCK=1024)
    y = y.view(*x.shape[:-1], *([1] if keepdim else [])).to(dtype or x.dtype)
    return y


def enable(on: bool, dispatch_key: str = "CUDA") -> None:
    """Install (or remove) the batch-invariant implementations for `dispatch_key`: CUDA in the
    deterministic mode; the interpreter tests install them for CPU tensors."""
    global _LIB
    if on and _LIB is None:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("mm", lambda a, b: mm(a, b), dispatch_key)
        lib.impl("addmm", _addmm, dispatch_key)
        lib.impl("bmm", lambda a, b: mm(a, b), dispatch_key)
        lib.impl("mean.dim", _mean_dim, dispatch_key)
        _LIB = lib
    elif not on and _LIB is not None:
        _LIB._destroy()
        _LIB = None
