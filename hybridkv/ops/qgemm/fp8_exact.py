"""Weights the release ships in FP8 and its conversion widens to bf16 (`wo_a`: the reference's
convert.py dequantises it), stored back as FP8 without losing a bit, and the grouped few-row GEMM
that reads them.

- `exact_fp8`: a bf16 (or float32) weight [N, K] -> e4m3 [N, K] and e8m0 scales per 128×128 block,
  or None unless every value is an e4m3 value times its block's power of two. Whatever power of two
  the release scaled a block by, the one from the block's largest magnitude (the smallest that keeps
  it within e4m3's 448) holds the same values exactly, so the weight the GEMM reads is the one the
  conversion wrote, at half its bytes.
- `grouped_rows`: x [T, G, K] (bf16) · w[g·R:(g+1)·R]ᵀ for each group g -> [T, G, R], the weight in
  e4m3 with its scales. The activations stay bf16, as the reference multiplies them: products of a
  bf16 value and a widened e4m3 value are exact in float32, so only the order of the float32 sums
  differs from the dense GEMM. On CUDA for up to `MAX_ROWS` rows one Triton launch
  (`grouped_rows_kernel`: [BM, BN] tiles of one group each, K split over programs as in
  `float_rows` where the tiles alone leave SMs idle); elsewhere, and in deterministic mode, the
  weight widened for the call and the dense einsum (the numbers of the bf16 weight, bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import interpreting, is_deterministic, use_triton
from hybridkv.ops.pdl import triton_args
from hybridkv.ops.pdl_device import wait_then_release
from hybridkv.ops.qgemm import float_rows
from hybridkv.ops.qgemm.float_rows import split_tile, store_split_tile
from hybridkv.ops.qgemm.layout import _e8m0
from hybridkv.ops.qgemm.triton import _arrivals
from hybridkv.ops.quant.reference import dequant_fp8_weight

BLOCK = 128                   # the release's FP8 block (both ways)
E4M3_MAX = 448.0
MAX_ROWS = 256                # more rows (prefill chunks): the widened weight and the dense einsum


def exact_fp8(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 [N, K], e8m0 [N/block, K/block]) holding `weight` exactly, or None where a value is not an
    e4m3 value times its block's power of two (or a dimension is not a whole number of blocks)."""
    n, k = weight.shape
    if n % block or k % block or not weight.is_floating_point() or weight.dtype.itemsize < 2:
        return None
    w = weight.float().view(n // block, block, k // block, block)
    amax = w.abs().amax(dim=(1, 3))
    if not bool(torch.isfinite(amax).all()):
        return None
    # the smallest power of two that keeps the block within e4m3 (an all-zero block: any; 2^-127)
    exp = torch.where(amax > 0, torch.ceil(torch.log2(amax / E4M3_MAX)), torch.full_like(amax, -127.0))
    exp = exp.clamp(-127, 127)
    q = w / torch.exp2(exp)[:, None, :, None]                  # exact: a power of two
    e4m3 = q.to(torch.float8_e4m3fn)
    if not bool((e4m3.float() == q).all()):
        return None
    scale = torch.exp2(exp).to(torch.float8_e8m0fnu)
    return e4m3.view(n, k), scale


@triton.jit
def grouped_rows_kernel(X, W, S, Y, P, CNT, M, N, K, GROUP_N, stride_xt, stride_xg, stride_w, stride_s,
                        stride_yt, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                        IEEE: tl.constexpr, FENCE: tl.constexpr, PDL: tl.constexpr):
    """Y[t, n] = Σ_k X[t, n // GROUP_N, k] · W[n, k] · 2^S[n // BK, k // BK]: a [BM, BN] tile per
    program (BN divides GROUP_N and BK), its K range the pid_k-th of SPLIT_K."""
    wait_then_release(PDL)
    pid, pid_k, rm, rn, kb0, kb1 = split_tile(M, N, K, BM, BN, BK, SPLIT_K)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    xg = X + (tl.min(rn, 0) // GROUP_N).to(tl.int64) * stride_xg
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        k = kb * BK + rk
        x = tl.load(xg + rm.to(tl.int64)[:, None] * stride_xt + k[None, :], mask=m_ok[:, None], other=0.0)
        w = tl.load(W + rn.to(tl.int64)[:, None] * stride_w + k[None, :], mask=n_ok[:, None], other=0.0)
        s = _e8m0(tl.load(S + (rn // BK) * stride_s + kb, mask=n_ok, other=127))
        if IEEE:
            d = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            d = tl.dot(x, tl.trans(w.to(tl.bfloat16)))
        acc += d * s[None, :]
    store_split_tile(Y, stride_yt, acc, P, CNT, pid, pid_k, rm, rn, M, N, SPLIT_K, FENCE)


def rows_config(m: int, n: int, k: int) -> dict:
    """[16–64]-row tiles of 32 weight rows, 128 deep (one scale block), four loads in flight, K split
    only until the tiles cover every SM once. Swept on an H100 at V4-Flash's `wo_a` (8 × 1024 rows
    over 4096, weights read from DRAM; `benchmarks/qgemm_kernels.py --fp8-exact --sweep --cold`):
    16.3 µs at one row and 26.9 at 64 against 23.0 and 34.7 for `float_rows`' 64-row tiles split
    four ways."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn = 32
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    n_kb = triton.cdiv(k, BLOCK)
    split = 1
    while split * 2 <= n_kb // 2 and tiles * split < float_rows.NUM_SMS_GUESS:
        split *= 2
    return dict(BM=bm, BN=bn, BK=BLOCK, SPLIT_K=split, num_warps=4, num_stages=4)


def kernel_ok(x: torch.Tensor) -> bool:
    """Whether `grouped_rows` takes the Triton launch for this input: the Triton path, at most
    `MAX_ROWS` rows of bf16 (fp16) without a gradient, not deterministic mode (whose GEMMs are
    batch-invariant; this split depends on the rows)."""
    return (use_triton(x) and not is_deterministic() and x.dtype in (torch.bfloat16, torch.float16)
            and x.shape[0] <= MAX_ROWS and not (torch.is_grad_enabled() and x.requires_grad))


def grouped_rows(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: dict | None = None,
                 force_kernel: bool = False) -> torch.Tensor:
    """x [T, G, K] · (e4m3 weight [G·R, K] with e8m0 scales per 128×128)ᵀ by group -> [T, G, R] in
    x's dtype. `force_kernel`: the Triton launch whatever `kernel_ok` says (tests)."""
    t, g, k = x.shape
    n = weight.shape[0]
    if n % g or weight.shape[1] != k:
        raise ValueError(f"grouped_rows: weight {tuple(weight.shape)} does not split into {g} groups of {k} inputs")
    r = n // g
    if not (force_kernel or kernel_ok(x)):
        dense = dequant_fp8_weight(weight, scale, (BLOCK, BLOCK), x.dtype).view(g, r, k)
        return torch.einsum("tgd,grd->tgr", x, dense)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cfg = dict(config or rows_config(t, n, k))
    if r % cfg["BN"] or BLOCK % cfg["BN"] or cfg["BK"] != BLOCK:
        raise ValueError(f"grouped_rows: tiles {cfg} must fit the groups of {r} rows and the {BLOCK}-blocks")
    y = torch.empty(t, g, r, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    split = cfg.pop("SPLIT_K")
    tiles = triton.cdiv(t, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
    partials = torch.empty(split, t, n, dtype=torch.float32, device=x.device) if split > 1 else y
    counters = _arrivals(x.device, tiles) if split > 1 else y
    grouped_rows_kernel[(tiles, split)](
        x, weight, scale.view(torch.uint8), y, partials, counters, t, n, k, r, x.stride(0), x.stride(1),
        weight.stride(0), scale.stride(0), y.stride(0), SPLIT_K=split, IEEE=interpreting(),
        FENCE=not interpreting(), **cfg, **triton_args(x))
    return y
