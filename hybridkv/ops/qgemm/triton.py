"""Triton GEMMs that read the release's packed weights; no dense copy of a weight is ever made.

- `fp8_linear`: e4m3 weight [N, K] with one e8m0 scale per b×b tile (b = 128 in V4's release,
  32 in V4.1's). The input is first quantised to e4m3 codes and power-of-two scales per b values
  (`act_codes`, the rounding of `act_quant_sim`); the GEMM multiplies codes by codes on the FP8
  tensor cores and applies the input's and the weight's scales to each b-deep block's fp32 partial
  sum (the promotion the release's kernels do), so no operand is ever widened in registers. Two
  configurations: decode (≤ 64 rows: 16-row tiles, the K loop split over programs so that a few
  rows still spread over every SM, partial sums added and cast by one launch) and prefill (128×128
  tiles, grouped launch order for L2 reuse; on CUDA prefill usually runs through
  `hybridkv.ops.qgemm.scaled` instead).
- `grouped_fp4`: the routed experts' packed E2M1 weights (two per byte, low nibble = even element,
  e8m0 scale per 32 inputs, multiplied by Triton's scaled dot, which widens them on the way to the
  MMA) over rows sorted by expert, their activations round-tripped through FP8 beforehand (`hybridkv.ops.grouped_moe`), one launch
  for all experts: each program owns a tile of one expert's rows (the tile table says which) and
  reads that expert's weight at its offset in the projection's stacked buffer (`MoE` makes its
  experts' parameters views of one buffer per projection), or through a table of per-expert
  addresses for experts that are separate tensors; Triton 3.6 pipelines only the former correctly.
  With `swiglu` the program runs w1 and w3 together and writes the clamped SwiGLU times the
  routing weight, what w2 reads. At decode sizes the same call runs, on CUDA, `fp4_mma`'s kernel
  (tiles of up to 8 rows on the tensor cores, operands built in registers, CUDA C++), and
  elsewhere (the interpreter) `fp4_rows`' kernel: one sorted row per program on the CUDA cores.

Under the interpreter (CPU tests) the MMAs run in fp32: the interpreter's bf16 and fp8 dots are not
usable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hybridkv.ops.backend import interpreting
from hybridkv.ops.qgemm import fp4_mma
from hybridkv.ops.qgemm.fp4_rows import grouped_fp4_rows
from hybridkv.ops.qgemm.layout import FP4_BLOCK, _e8m0, _expert_base
from hybridkv.ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX
from hybridkv.ops.quant.triton import _bf16_round, _e4m3_round

SCALE_BLOCK = 128      # V4's FP8 weights: the scale tile, also the K step and the activation block
FP8_BLOCKS = (32, 64, 128)   # the square scale tiles `fp8_linear` takes (V4.1's release: 32)
NUM_SMS_GUESS = 132    # H200; only sizes the decode split
DECODE_ROWS = 64       # at most this many rows: the decode tiles (and, on CUDA, this GEMM rather than torch's)


@triton.jit
def _act_scales(amax, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """Per-row power-of-two scale and its inverse for the FP8 round trip, from each row's amax."""
    t = tl.maximum(amax, FLOOR) * (1.0 / QMAX)
    s_bits = (t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000
    return s_bits.to(tl.float32, bitcast=True), (0x7F000000 - s_bits).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(nib):
    """4-bit E2M1 codes (int32, bit 3 the sign) -> float32 values."""
    e = (nib >> 1) & 3
    m = nib & 1
    bits = tl.where(e > 0, ((126 + e) << 23) | (m << 22), m * (126 << 23))
    return (bits | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def act_codes_kernel(X, Q, S, M, MP, K, stride_x, s_stride_row, s_stride_blk,
                     FLOOR: tl.constexpr, QMAX: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    """Rows [R] of one BLOCK-column block of x -> e4m3 codes and the block's power-of-two scale per row
    (rows in [M, MP), the padding, get zero codes)."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    kb = tl.program_id(1)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_x + cols[None, :], mask=(rows < M)[:, None], other=0.0)
    x = x.to(tl.float32)
    s, inv = _act_scales(tl.max(tl.abs(x), 1), FLOOR, QMAX)
    q = _e4m3_round(tl.minimum(tl.maximum(x * inv[:, None], -QMAX), QMAX))
    keep = rows < MP
    tl.store(Q + rows.to(tl.int64)[:, None] * K + cols[None, :], q.to(Q.dtype.element_ty), mask=keep[:, None])
    tl.store(S + rows.to(tl.int64) * s_stride_row + kb * s_stride_blk, s, mask=keep)


def act_codes(x2: torch.Tensor, row_pad: int = 1, outer_major: bool = False,
              block: int = SCALE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [Mp, K], float32 power-of-two scales [Mp, K/block]), the activation
    quantisation of `act_quant_sim` (x = codes × scale per `block` values) with Mp = M rounded up to
    `row_pad`; the scales' memory is [K/block, Mp] (outer-dim-major) when `outer_major`."""
    m, k = x2.shape
    mp = -(-m // row_pad) * row_pad
    q = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x2.device)
    if outer_major:
        s = torch.empty(k // block, mp, dtype=torch.float32, device=x2.device).t()
    else:
        s = torch.empty(mp, k // block, dtype=torch.float32, device=x2.device)
    if mp:
        r = 16
        act_codes_kernel[(triton.cdiv(mp, r), k // block)](
            x2, q, s, m, mp, k, x2.stride(0), s.stride(0), s.stride(1), FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX, R=r,
            BLOCK=block)
    return q, s


@triton.jit
def _gpu_fence(NEEDED: tl.constexpr):
    """Each thread's earlier global writes visible GPU-wide before the barrier that follows (the
    split-K arrival count), or each thread acquiring after it (the last arrival's reads). Nothing in
    the interpreter, whose programs run one after another."""
    if NEEDED:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)


@triton.jit
def _split_k_arrive(P, CNT, tile, pid_k, at, acc, ok, M, N, SPLIT_K: tl.constexpr, FENCE: tl.constexpr):
    """Store this program's share of a split-K tile into P [SPLIT_K, M, N] (`at`: the tile's offsets
    in one [M, N] plane) and count its arrival in CNT[tile]; whether it arrived last."""
    tl.store(P + pid_k.to(tl.int64) * M * N + at, acc, mask=ok)
    _gpu_fence(FENCE)
    tl.debug_barrier()
    return tl.atomic_add(CNT + tile, 1, sem="acq_rel") == SPLIT_K - 1


@triton.jit
def _split_k_total(P, CNT, tile, at, ok, M, N, SPLIT_K: tl.constexpr, FENCE: tl.constexpr):
    """In the last program to arrive: the tile's shares added in split order (whatever order the
    programs ran in), and CNT[tile] reset to zero for the next launch."""
    _gpu_fence(FENCE)
    total = tl.load(P + at, mask=ok, other=0.0, cache_modifier=".cg")
    for j in tl.static_range(1, SPLIT_K):
        total += tl.load(P + tl.full([], j, tl.int64) * M * N + at, mask=ok, other=0.0, cache_modifier=".cg")
    tl.atomic_xchg(CNT + tile, 0)
    return total


@triton.jit
def fp8_gemm_kernel(X, XQ, XS, W, WS, Y, P, CNT, M, N, K, stride_x, stride_xq, xs_row, xs_blk, stride_ym, ws_stride,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    SPLIT_K: tl.constexpr, GROUP_M: tl.constexpr, NATIVE: tl.constexpr, QUANT_IN: tl.constexpr,
                    OUT_BF16: tl.constexpr, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """One [BM, BN] tile of codes × codes, K in BK-deep steps (BK: the weight's square scale tile
    and the input's quantisation block). QUANT_IN: the program quantises its own rows of X per
    BK values (`act_codes`' rounding, bit for bit) instead of reading XQ/XS. SPLIT_K > 1: each
    program adds a share of the K blocks into P [SPLIT_K, M, N]; the last of a tile's programs to
    arrive (CNT counts them and is reset to zero) adds the shares in split order and stores Y."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    n_kb = K // BK
    per = tl.cdiv(n_kb, SPLIT_K)
    kb0 = pid_k * per
    kb1 = tl.minimum(kb0 + per, n_kb)
    srow = (pid_n * BN) // BK          # where BN ≤ BK: BN divides the scale tile, one scale a tile
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(kb0, kb1):
        if QUANT_IN:
            xv = tl.load(X + rm.to(tl.int64)[:, None] * stride_x + (kb * BK + rk)[None, :], mask=m_ok[:, None],
                         other=0.0).to(tl.float32)
            xs, inv = _act_scales(tl.max(tl.abs(xv), 1), FLOOR, QMAX)
            xq = _e4m3_round(tl.minimum(tl.maximum(xv * inv[:, None], -QMAX), QMAX))
            if NATIVE:
                xq = xq.to(tl.float8e4nv)
        else:
            xq = tl.load(XQ + rm.to(tl.int64)[:, None] * stride_xq + (kb * BK + rk)[None, :], mask=m_ok[:, None],
                         other=0.0)
            xs = tl.load(XS + rm * xs_row + kb * xs_blk, mask=m_ok, other=0.0)
        w = tl.load(W + rn.to(tl.int64)[:, None] * K + (kb * BK + rk)[None, :], mask=n_ok[:, None], other=0.0)
        if NATIVE:     # e4m3 × e4m3 on the tensor cores, promoted to fp32 once per BK-deep block
            d = tl.dot(xq, tl.trans(w))
        else:
            d = tl.dot(xq.to(tl.float32), tl.trans(w.to(tl.float32)))
        if BN <= BK:
            acc += d * (xs[:, None] * _e8m0(tl.load(WS + srow * ws_stride + kb)))
        else:          # the tile spans several scale tiles: one scale per output column
            s = _e8m0(tl.load(WS + (rn // BK) * ws_stride + kb, mask=n_ok, other=0))
            acc += d * (xs[:, None] * s[None, :])
    at = rm.to(tl.int64)[:, None] * N + rn[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty), mask=ok)
    else:
        if _split_k_arrive(P, CNT, pid, pid_k, at, acc, ok, M, N, SPLIT_K, NATIVE):
            total = _split_k_total(P, CNT, pid, at, ok, M, N, SPLIT_K, NATIVE)
            if OUT_BF16:   # round to nearest by hand: the interpreter's own cast truncates
                total = _bf16_round(total)
            tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], total.to(Y.dtype.element_ty), mask=ok)


def fp8_config(m: int, n: int, k: int, block: int = SCALE_BLOCK) -> dict:
    """Tile sizes for an [m, k] × [n, k]ᵀ FP8 GEMM with `block`-deep K steps: decode-shaped (few
    rows) or prefill-shaped."""
    if m <= DECODE_ROWS:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn = 64
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        n_kb = k // block
        split = 1
        while split * 2 <= n_kb // 2 and tiles * split < 2 * NUM_SMS_GUESS:
            split *= 2
        return dict(BM=bm, BN=bn, SPLIT_K=split, GROUP_M=1, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, SPLIT_K=1, GROUP_M=8, num_warps=8, num_stages=3)


_ARRIVALS: dict = {}     # device -> int32 split-K arrival counters, all zero between launches


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed counters on `device` (each launch leaves them zero again). Made
    outside CUDA-graph capture: a buffer first made inside one would belong to that graph. One
    buffer a device: split-K launches must not run concurrently on two streams (the engine's
    decode steps, eager or replayed, run one after another)."""
    key = (device.type, device.index)
    have = _ARRIVALS.get(key)
    if have is None or have.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K FP8 GEMM: {tiles} arrival counters needed inside CUDA-graph capture, "
                               f"{0 if have is None else have.numel()} made; run the shape once before capture")
        _ARRIVALS[key] = have = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return have


# Inputs of at most 16 rows into e4m3 weights of at most 8 MiB are quantised inside the GEMM. On the
# H200 (2026-12-02) that saved a launch and 1-3 µs at V4-Flash's small linears, but cost 1.2-1.5×
# at its two 32 MiB ones (every column tile repeats the rows' quantisation) and 2-3× at 64 rows.
QUANT_IN_ROWS = 16
QUANT_IN_WEIGHT = 8 << 20


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
               config: dict | None = None, quantise_in: bool | None = None, block: int = SCALE_BLOCK) -> torch.Tensor:
    """x [..., K] -> [..., N] of out_dtype, the weight e4m3 [N, K] with e8m0 scales per block×block
    tile (one of `FP8_BLOCKS`); the input is quantised to e4m3 per `block` values (`act_codes`'
    rounding) and the GEMM multiplies codes by codes and applies both scales per block-deep step. With K split (decode
    shapes) the last program of each tile adds the partial sums. The input is quantised inside the
    GEMM (`quantise_in`; by default for few rows into small weights, see QUANT_IN_ROWS) or first
    by `act_codes` (one more launch)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if block not in FP8_BLOCKS or k % block:
        raise ValueError(f"FP8 linear: scale tiles of {block} (one of {FP8_BLOCKS}) for K {k}")
    cfg = dict(config or fp8_config(m, n, k, block))
    split = cfg.pop("SPLIT_K")
    y = torch.empty(m, n, dtype=out_dtype, device=x.device)
    if m:
        tiles = triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"])
        quant_in = (m <= QUANT_IN_ROWS and n * k <= QUANT_IN_WEIGHT) if quantise_in is None else quantise_in
        xq, xs = (x2, x2) if quant_in else act_codes(x2, block=block)
        partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
        counters = _arrivals(x.device, tiles) if split > 1 else y
        fp8_gemm_kernel[(tiles, split)](
            x2, xq, xs, weight, scale.view(torch.uint8), y, partials, counters, m, n, k, x2.stride(0), xq.stride(0),
            xs.stride(0) if not quant_in else 0, xs.stride(1) if not quant_in else 0, n, scale.stride(0),
            BK=block, SPLIT_K=split, NATIVE=not interpreting(), QUANT_IN=quant_in,
            OUT_BF16=out_dtype == torch.bfloat16, FLOOR=FP8_AMAX_FLOOR, QMAX=FP8_MAX, **cfg)
    return y.view(*lead, n)


def fp8_supported(weight: torch.Tensor, block: tuple[int, int]) -> bool:
    """Square scale tiles of `FP8_BLOCKS`, K a multiple of the tile."""
    return block[0] == block[1] and block[0] in FP8_BLOCKS and weight.shape[1] % block[0] == 0


@triton.jit
def _fp4_block_dot(acc, x, xe, xo, w, sc, rn, n_ok, w_stride, s_stride, kb, rb,
                   BK: tl.constexpr, BN: tl.constexpr, FP4_DOT: tl.constexpr):
    """acc + x·wᵀ over one BK-deep block of packed E2M1 weights with e8m0 scales per 32 inputs.
    FP4_DOT 1 (2): Triton's scaled dot widens the codes (`tl.dot_scaled`, the weight read as
    [BK/2, BN] bytes; 2 with the nibbles of each byte swapped first). FP4_DOT 0: the low nibbles
    (even inputs, `xe`) and high nibbles (odd inputs, `xo`) are decoded and multiplied separately
    with float32 operands (exact: e2m1 and e4m3 values times powers of two fit tf32)."""
    if FP4_DOT > 0:
        b = tl.load(w + rn.to(tl.int64)[None, :] * w_stride + (kb * (BK // 2) + rb)[:, None], mask=n_ok[None, :],
                    other=0)
        if FP4_DOT == 2:
            b = (b << 4) | (b >> 4)
        rs = tl.arange(0, BK // 32)
        sb = tl.load(sc + rn.to(tl.int64)[:, None] * s_stride + (kb * (BK // 32) + rs)[None, :], mask=n_ok[:, None],
                     other=127)
        acc = tl.dot_scaled(x, None, "bf16", b, sb, "e2m1", acc)
    else:
        b = tl.load(w + rn.to(tl.int64)[:, None] * w_stride + (kb * (BK // 2) + rb)[None, :], mask=n_ok[:, None],
                    other=0).to(tl.int32)
        scale = _e8m0(tl.load(sc + rn.to(tl.int64)[:, None] * s_stride + (kb * (BK // 32) + rb // 16)[None, :],
                              mask=n_ok[:, None], other=127))
        acc += tl.dot(xe, tl.trans(_e2m1(b & 15) * scale))
        acc += tl.dot(xo, tl.trans(_e2m1(b >> 4) * scale))
    return acc


@triton.jit
def grouped_fp4_kernel(X, ROWS, TILE_E, TILE_S, TILE_T, WP1, SP1, WP3, SP3, ROUTE, Y, N, K, w_stride, s_stride,
                       ew_stride, es_stride, stride_x, limit,
                       GATHER: tl.constexpr, SWIGLU: tl.constexpr, FP4_DOT: tl.constexpr, TABLE: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(TILE_E + pid_m)
    if e < 0:
        return
    start, end = tl.load(TILE_S + pid_m), tl.load(TILE_T + pid_m)
    r = start + tl.arange(0, BM)
    r_ok = r < end
    src = tl.load(ROWS + r, mask=r_ok, other=0) if GATHER else r
    rn = pid_n * BN + tl.arange(0, BN)
    n_ok = rn < N
    w1, s1 = _expert_base(WP1, e, ew_stride, TABLE), _expert_base(SP1, e, es_stride, TABLE)
    w3, s3 = w1, s1
    if SWIGLU:
        w3, s3 = _expert_base(WP3, e, ew_stride, TABLE), _expert_base(SP3, e, es_stride, TABLE)
    rb = tl.arange(0, BK // 2)
    xrow = X + src.to(tl.int64)[:, None] * stride_x
    acc1 = tl.zeros((BM, BN), dtype=tl.float32)
    acc3 = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, K // BK):
        if FP4_DOT > 0:
            x = tl.load(xrow + (kb * BK + tl.arange(0, BK))[None, :], mask=r_ok[:, None], other=0.0).to(tl.bfloat16)
            xe, xo = x, x
        else:
            x = None
            xe = tl.load(xrow + (kb * BK + 2 * rb)[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
            xo = tl.load(xrow + (kb * BK + 2 * rb + 1)[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
        acc1 = _fp4_block_dot(acc1, x, xe, xo, w1, s1, rn, n_ok, w_stride, s_stride, kb, rb, BK, BN, FP4_DOT)
        if SWIGLU:
            acc3 = _fp4_block_dot(acc3, x, xe, xo, w3, s3, rn, n_ok, w_stride, s_stride, kb, rb, BK, BN, FP4_DOT)
    if SWIGLU:
        # each projection's output is rounded to the compute dtype, as `Linear` returns it
        gate = acc1.to(Y.dtype.element_ty).to(tl.float32)
        up = acc3.to(Y.dtype.element_ty).to(tl.float32)
        if limit > 0:
            up = tl.minimum(tl.maximum(up, -limit), limit)
            gate = tl.minimum(gate, limit)
        route = tl.load(ROUTE + r, mask=r_ok, other=0.0)
        out = route[:, None] * (gate * tl.sigmoid(gate) * up)
    else:
        out = acc1
    tl.store(Y + r.to(tl.int64)[:, None] * N + rn[None, :], out.to(Y.dtype.element_ty),
             mask=r_ok[:, None] & n_ok[None, :])


FP4_DOT_NAMES = {0: "codes decoded in registers, float32 MMA", 1: "tl.dot_scaled", 2: "tl.dot_scaled, nibbles swapped"}
_FP4_DOT: dict = {}       # device -> FP4Check


class FP4Check(NamedTuple):
    """What the device check found: the multiply mode of stacked experts and of address-table
    launches (checked apart: one variant failing to compile must not slow the other), whether the
    stacked K loop may pipeline, and a sentence for reports."""
    stacked: int
    table: int
    pipelined: bool
    report: str


def _device_key(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _fp4_state(device: torch.device) -> FP4Check:
    key = _device_key(device)
    if key not in _FP4_DOT:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the grouped FP4 kernel's first call on a device must run outside CUDA-graph capture "
                               "(it checks Triton's scaled dot once)")
        _FP4_DOT[key] = _check_fp4_dot(torch.device("cuda", key))
    return _FP4_DOT[key]


def fp4_dot_mode(device: torch.device, table: bool = False) -> int:
    """How the grouped FP4 kernel multiplies on `device` (for stacked experts, or with `table` for
    address tables): 0 in the interpreter; on a GPU the first of Triton's scaled dot (1, then 2)
    that agrees with the register decoding (0) on a random problem, checked once per device (Triton
    releases have differed in how `dot_scaled` reads packed E2M1), else 0. `fp4_dot_report` says
    what was found."""
    if interpreting() or device.type != "cuda":
        return 0
    state = _fp4_state(device)
    return state.table if table else state.stacked


def fp4_pipelined(device: torch.device) -> bool:
    """Whether the scaled-dot K loop over stacked experts may be software-pipelined on `device`:
    the device check compares a pipelined launch with the unpipelined one. (Triton 3.6 pipelines
    `tl.dot_scaled` wrongly when the weight's address comes from a table, rel err 1.3 on the H200,
    so table launches never pipeline; this checks that the stacked layout's launches agree.)"""
    if interpreting() or device.type != "cuda":
        return True
    return _fp4_state(device).pipelined


def fp4_dot_report(device: torch.device) -> str:
    if interpreting() or device.type != "cuda":
        return FP4_DOT_NAMES[0]
    return _fp4_state(device).report


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def _first_agreeing_mode(run, want) -> tuple[int, str]:
    """The first scaled-dot mode whose `run(mode)` agrees with `want`, else 0; and what was found."""
    found = []
    for mode in (1, 2):
        try:
            err = _rel_rms(run(mode), want)
        except Exception as e:  # what this Triton cannot compile is the finding
            found.append(f"{FP4_DOT_NAMES[mode]}: {type(e).__name__}")
            continue
        if err < 1e-3:
            return mode, f"{FP4_DOT_NAMES[mode]} (agrees with register decoding, rel rms {err:.1e})"
        found.append(f"{FP4_DOT_NAMES[mode]} disagrees (rel rms {err:.1e})")
    return 0, f"{FP4_DOT_NAMES[0]} ({'; '.join(found)})"


def _check_fp4_dot(device: torch.device) -> FP4Check:
    g = torch.Generator(device=device).manual_seed(0)
    p, k, n = 20, 512, 256
    x = torch.randn(p, k, device=device, generator=g).bfloat16()
    from hybridkv.ops.quant.triton import fp8_round_trip
    x = fp8_round_trip(x, SCALE_BLOCK)
    w = torch.randint(0, 256, (2, n, k // 2), device=device, generator=g, dtype=torch.uint8)
    sc = torch.randint(120, 130, (2, n, k // FP4_BLOCK), device=device, generator=g).to(torch.uint8)
    table = (torch.tensor([w[0].data_ptr(), w[1].data_ptr()], dtype=torch.int64, device=device),
             torch.tensor([sc[0].data_ptr(), sc[1].data_ptr()], dtype=torch.int64, device=device))
    tiles = tuple(torch.tensor(v, dtype=torch.int32, device=device) for v in ([0, 1], [0, 16], [16, p]))
    one, three = dict(BM=16, BN=64, num_warps=4, num_stages=1), dict(BM=16, BN=64, num_warps=4, num_stages=3)
    want = grouped_fp4(x, None, tiles, (w, sc), n, torch.float32, config=one, fp4_dot=0)
    stacked, said_stacked = _first_agreeing_mode(
        lambda m: grouped_fp4(x, None, tiles, (w, sc), n, torch.float32, config=one, fp4_dot=m, pipelined=False), want)
    by_table, said_table = _first_agreeing_mode(
        lambda m: grouped_fp4(x, None, tiles, table, n, torch.float32, config=one, fp4_dot=m), want)
    piped, why = True, "register decoding pipelines"
    if stacked:
        try:
            err = _rel_rms(grouped_fp4(x, None, tiles, (w, sc), n, torch.float32, config=three, fp4_dot=stacked,
                                       pipelined=True), want)
        except Exception as e:
            err, why = float("inf"), type(e).__name__
        else:
            why = f"rel rms {err:.1e}"
        piped = err < 1e-3
    report = (f"stacked experts: {said_stacked}, pipelined {'agrees' if piped else 'disagrees, so unpipelined'} "
              f"({why}); address tables: {said_table}")
    return FP4Check(stacked, by_table, piped, report)


MMA_MAX_PAIRS = 512        # pairs that take the MMA tiles whatever the experts (the one-launch routing's limit)
MMA_ROWS_PER_EXPERT = 16   # with the expert count known, up to this many pairs an expert on average do too


def grouped_config(pairs: int, n: int, experts: int | None = None, gated: bool = False, mma: bool = False) -> dict:
    """Tiles of the grouped FP4 GEMM (`gated`: the w1/w3 launch with its SwiGLU). Without `mma`:
    decode, at most one row for every two experts (64 pairs when `experts` is not given), one row
    per program on the CUDA cores (`fp4_rows`, BM 1; on the H200 at V4-Flash's width 1.6× faster
    than the tensor-core tiles at 1 and 8 tokens); otherwise 16-row tiles up to 512 pairs, 64-row
    tiles beyond. A config may also set BK, the inputs one loop iteration
    multiplies (a multiple of 128 dividing K; 128 for the tiles, up to 256 for one row, when absent).
    `mma` (the caller checked `fp4_mma.usable`): up to `MMA_MAX_PAIRS` pairs, or `MMA_ROWS_PER_EXPERT`
    an expert, run as tiles of at most 8 rows on the tensor cores with operands built in registers
    (`fp4_mma`; on the H200 2.3× / 2.0× faster than the 16-row tiles at 64 tokens for w1-w3 / w2,
    1.5× / 1.2× than one row at 8, the same at 1: `benchmarks/qgemm_kernels.py --sweep --families
    mma`). Past 512 pairs the 64-row tiles hold a few rows of each expert (768 pairs among 256 experts:
    3 an expert), and their emulated FP4 products cost most of a decode step of 128 rows."""
    if mma and pairs <= max(MMA_MAX_PAIRS, MMA_ROWS_PER_EXPERT * (experts or 0)):
        return dict(BM=fp4_mma.TILE_ROWS, MMA=True, **fp4_mma.config(pairs, gated))
    if pairs <= (experts // 2 if experts else 64):
        return dict(BM=1, BN=32 if gated else 64, num_warps=4)
    if pairs <= 512:
        return dict(BM=16, BN=64, num_warps=4, num_stages=3)
    return dict(BM=64, BN=128, num_warps=8, num_stages=3)


def grouped_fp4(x: torch.Tensor, rows: torch.Tensor | None, tiles: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                w1: tuple[torch.Tensor, torch.Tensor], n: int, out_dtype: torch.dtype,
                w3: tuple[torch.Tensor, torch.Tensor] | None = None, route: torch.Tensor | None = None,
                limit: float = 0.0, config: dict | None = None, fp4_dot: int | None = None,
                pipelined: bool | None = None, shift: int = 0) -> torch.Tensor:
    """Sorted rows P (x[rows[i]] for row i, or x's own rows with rows None) × their experts' packed
    weights -> [P, n] of out_dtype. x holds the activations already through their FP8 round trip
    (`act_quant_sim` per the checkpoint's block; exact in bf16), so the kernel reads them as they are.
    `tiles` = (expert, first row, end row) per row tile, built by
    `hybridkv.ops.grouped_moe.expert_tiles` with the same BM; w1/w3 = (weights, scales) of every
    expert: the experts stacked (uint8 [E, N, K/2] and [E, N, K/32], any stride between experts),
    or int64 tables of each expert's weight and scale address. With w3 the SwiGLU of (w1, w3) times
    `route` [P] is returned. `pipelined` (default: what the device check found) lets the scaled-dot
    K loop over stacked experts pipeline. `shift`: the MMA kernel's scale shift
    (`fp4_mma.scale_shift` of the experts' largest scale byte)."""
    cfg = dict(config or grouped_config(rows.shape[0] if rows is not None else x.shape[0], n, gated=w3 is not None))
    p = rows.shape[0] if rows is not None else x.shape[0]
    k = x.shape[-1]
    y = torch.empty(p, n, dtype=out_dtype, device=x.device)
    if p == 0:
        return y
    swiglu = w3 is not None
    rows_bk = cfg.get("BK")         # the one-row kernel's own default when absent
    bk = cfg.pop("BK", SCALE_BLOCK)
    if bk % SCALE_BLOCK or k % bk or bk & (bk - 1):
        raise ValueError(f"grouped FP4: BK {bk} must be a power-of-two multiple of {SCALE_BLOCK} dividing K = {k}")
    table = w1[0].dtype == torch.int64
    if not table and not (w1[0].dtype == w1[1].dtype == torch.uint8 and w1[0].dim() == w1[1].dim() == 3
                          and w1[0].stride(1) == k // 2 and w1[1].stride(1) == k // FP4_BLOCK
                          and w1[0].stride(2) == w1[1].stride(2) == 1):
        raise ValueError("grouped FP4: weights must be address tables (int64) or stacked uint8 experts "
                         "[E, N, K/2] and [E, N, K/32] with contiguous rows")
    ew, es = (0, 0) if table else (w1[0].stride(0), w1[1].stride(0))
    if swiglu and not table and (w3[0].stride(0), w3[1].stride(0)) != (ew, es):
        raise ValueError("grouped FP4: w1 and w3 stacks must have the same strides")
    if cfg.pop("MMA", False):
        if cfg["BM"] > fp4_mma.TILE_ROWS:
            raise ValueError(f"grouped FP4 MMA: tiles of {cfg['BM']} rows > {fp4_mma.TILE_ROWS}")
        if max(ew, es) >= 2 ** 31:
            raise ValueError("grouped FP4 MMA: experts more than 2 GiB apart in their stack")
        return fp4_mma.grouped_fp4_mma(x, rows, tiles, w1, n, y, w3, route, limit, (ew, es), table, shift, cfg)
    if cfg["BM"] == 1:
        cfg["BK"] = rows_bk
        return grouped_fp4_rows(x, rows, tiles, w1, n, out_dtype, y, w3, route, limit, (ew, es), table, cfg)
    mode = fp4_dot_mode(x.device, table) if fp4_dot is None else fp4_dot
    if mode > 0 and (table or not (fp4_pipelined(x.device) if pipelined is None else pipelined)):
        # Triton 3.6's software pipelining of `tl.dot_scaled` reads wrong weights when their
        # address comes from a table (rel err 1.3 from num_stages=2 on, on the H200); stacked
        # experts pipeline where the device check found them right
        cfg["num_stages"] = 1
    grid = (tiles[0].shape[0], triton.cdiv(n, cfg["BN"]))
    grouped_fp4_kernel[grid](
        x, rows if rows is not None else tiles[0], *tiles, w1[0], w1[1], *(w3 if swiglu else w1),
        route if swiglu else x, y, n, k, k // 2, k // FP4_BLOCK, ew, es, x.stride(0), float(limit),
        GATHER=rows is not None, SWIGLU=swiglu, FP4_DOT=mode, TABLE=table, BK=bk, **cfg)
    return y
