"""The routed experts as grouped GEMMs over tokens sorted by expert. With the kernels on (FP4 experts,
activations quantised per 32, 64 or 128 values; on CUDA only with `cuda_kernel_enabled`) two
launches compute every routed expert: w1 and w3 with the SwiGLU and the routing weight, then w2,
each reading the packed FP4 weights; sorting, tiling and the weighted sum back are torch operations
without host synchronisation (CUDA-graph capturable). Prefill chunks large enough (`widen_ok`) widen
the experts with tokens to bf16 a group at a time for torch's grouped GEMM instead
(`routed_experts_widened`, one host read of the row offsets). Elsewhere `reference.routed_experts`:
one dense GEMM per expert segment."""

from __future__ import annotations

import array
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.ops.backend import dense_weights, use_triton
from hybridkv.ops.grouped_moe import reference  # noqa: F401
from hybridkv.ops.grouped_moe.reference import ExpertSort, combine, expert_tiles, sort_by_expert  # noqa: F401

ACT_BLOCK = 128      # V4's FP8 quantisation block of the activations in front of every expert GEMM
ACT_BLOCKS = (32, 64, 128)   # the blocks the kernels take (V4.1's release quantises per 32)


@dataclass(frozen=True)
class ExpertTables:
    """Where each routed expert's packed weight and scale lie, per projection, and the shapes the
    kernels need. Stacked experts (`stack_expert_storage`, what `MoE` builds): uint8 views
    [E, N, K/2] and [E, N, K/32] of the stacks, read by offset. Otherwise int64 tables of every
    expert's device addresses (launches that cannot pipeline on Triton 3.6, `qgemm.triton`). Built
    once per MoE (`expert_tables`); valid while the parameters stay where they are (`key`)."""
    w1: torch.Tensor
    s1: torch.Tensor
    w3: torch.Tensor
    s3: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    dim: int
    inter: int
    key: tuple
    scale_max: int = 127       # the largest e8m0 scale byte of any expert (`fp4_mma.scale_shift`)

    @property
    def stacked(self) -> bool:
        return self.w1.dtype != torch.int64


def _addresses(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    # frombuffer: a tensor from host data without a dispatched op, so a recorder of the captured
    # forward sees nothing even when the table is first built there (on CUDA it is built in the
    # warm-up before capture)
    return torch.frombuffer(array.array("q", [t.data_ptr() for t in tensors]), dtype=torch.int64).to(device, copy=True)


def table_key(projections: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> tuple:
    """What invalidates a table: the first and last experts' tensors moved or replaced."""
    return tuple((w.data_ptr(), s.data_ptr()) for proj in projections for w, s in (proj[0], proj[-1]))


def stack_expert_storage(linears: list[list[nn.Module]]) -> None:
    """Give the packed weights and scales of `linears` ([expert][projection] `Linear`s of one
    format and shape per projection) one buffer per projection and tensor, each expert's parameter
    a view of its slice: the layout the grouped kernels read by offset. Called where the experts
    are made (before loading), so no second copy ever exists."""
    for j in range(len(linears[0])):
        for attr in ("weight", "scale"):
            first = getattr(linears[0][j], attr)
            stack = torch.empty((len(linears), *first.shape), dtype=first.dtype, device=first.device)
            for e, row in enumerate(linears):
                setattr(row[j], attr, nn.Parameter(stack[e], requires_grad=False))


def _stacked(proj: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """uint8 [E, N, K/2] and [E, N, K/32] views of one projection's experts when they lie at equal
    steps in one storage (each contiguous), else None."""
    views = []
    for t in ([w for w, _ in proj], [s for _, s in proj]):
        first = t[0]
        step = t[1].data_ptr() - first.data_ptr() if len(t) > 1 else first.nbytes
        if (step < first.nbytes or step % first.element_size()
                or any(not x.is_contiguous() or x.shape != first.shape or x.untyped_storage().data_ptr()
                       != first.untyped_storage().data_ptr() or x.data_ptr() != first.data_ptr() + e * step
                       for e, x in enumerate(t))):
            return None
        base = first.view(torch.uint8)
        views.append(base.as_strided((len(t), *base.shape), (step, base.shape[1], 1)))
    return views[0], views[1]


def expert_tables(w1: list[tuple[torch.Tensor, torch.Tensor]], w3: list[tuple[torch.Tensor, torch.Tensor]],
                  w2: list[tuple[torch.Tensor, torch.Tensor]]) -> ExpertTables:
    """(packed weight int8 [N, K/2], e8m0 scale [N, K/32]) per expert and projection -> tables:
    stacked views where every projection's experts are stacked, address tables otherwise."""
    dev = w1[0][0].device
    inter, dim = w1[0][0].shape[0], w1[0][0].shape[1] * 2
    stacks = [_stacked(p) for p in (w1, w3, w2)]
    if all(st is not None for st in stacks) and stacks[0][0].stride() == stacks[1][0].stride() \
            and stacks[0][1].stride() == stacks[1][1].stride():
        (a1, b1), (a3, b3), (a2, b2) = stacks
        return ExpertTables(a1, b1, a3, b3, a2, b2, dim, inter, table_key([w1, w3, w2]), _scale_max([b1, b3, b2]))
    for proj in (w1, w3, w2):
        for w, s in proj:
            if not (w.is_contiguous() and s.is_contiguous()):
                raise ValueError("grouped FP4 experts need contiguous weights and scales")
            if w.data_ptr() % 16 or s.data_ptr() % 16:
                raise ValueError("grouped FP4 experts need 16-byte-aligned weights and scales (the kernel "
                                 "reads them with wide loads)")
    cols = [[w for w, _ in p] for p in (w1, w3, w2)] + [[s for _, s in p] for p in (w1, w3, w2)]
    a = [_addresses(c, dev) for c in cols]
    return ExpertTables(a[0], a[3], a[1], a[4], a[2], a[5], dim, inter, table_key([w1, w3, w2]),
                        _scale_max([s for p in (w1, w3, w2) for _, s in p]))


def _scale_max(scales: list[torch.Tensor]) -> int:
    """The largest e8m0 byte of these scale tensors (one host read)."""
    return int(torch.stack([s.view(torch.uint8).max() for s in scales]).max())


def cuda_kernel_enabled() -> bool:
    """Whether the grouped FP4 kernels run on CUDA: yes unless `HYBRIDKV_GROUPED_FP4=0`, which
    keeps dense bf16 expert copies instead (4x the bytes; a baseline for benchmarks)."""
    return os.environ.get("HYBRIDKV_GROUPED_FP4", "1") != "0"


def grouped_kernel_ok(x: torch.Tensor, act_block: int, dim: int, inter: int) -> bool:
    """Whether the grouped FP4 kernels run for x: the interpreter with HYBRIDKV_KERNELS=triton, or
    CUDA with `cuda_kernel_enabled()`; activation blocks of `ACT_BLOCKS`, both widths multiples
    of 128."""
    return (not dense_weights() and use_triton(x) and not (x.requires_grad and torch.is_grad_enabled())
            and (not x.is_cuda or cuda_kernel_enabled())
            and act_block in ACT_BLOCKS and dim % 128 == 0 and inter % 128 == 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def routed_experts_fp4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, tables: ExpertTables,
                       limit: float, out_dtype: torch.dtype, plus: torch.Tensor | Callable | None = None,
                       result_dtype: torch.dtype = torch.float32, act_block: int = ACT_BLOCK) -> torch.Tensor:
    """x [T, D], routing weights [T, k], ids [T, k] -> [T, D] of result_dtype: the routed experts'
    float32 sum (plus `plus` [T, D], the shared expert's output, when given; a callable giving it is
    called where its launches overlap a host wait), in two grouped
    launches over the sorted pairs and one that adds each token's rows; for decode sizes the
    sorting and tiling are one more launch (`triton.route`)."""
    from hybridkv.ops.grouped_moe import triton as combine_kernels
    from hybridkv.ops.qgemm import triton as kernels
    from hybridkv.ops.quant.triton import fp8_round_trip
    from hybridkv.ops.qgemm import fp4_mma
    n_experts = tables.w1.shape[0]
    p = ids.numel()
    if widen_ok(x, p, tables, out_dtype):
        return routed_experts_widened(x, weights, ids, tables, limit, plus=plus, result_dtype=result_dtype,
                                      act_block=act_block)
    if callable(plus):
        plus = plus()
    mma = out_dtype in (torch.bfloat16, torch.float32) and fp4_mma.usable(x, (tables.inter, tables.dim),
                                                                            (tables.dim, tables.inter))
    cfg_up = kernels.grouped_config(p, tables.inter, n_experts, gated=True, mma=mma)
    cfg_down = kernels.grouped_config(p, tables.dim, n_experts, mma=mma)
    shift = fp4_mma.scale_shift(tables.scale_max)
    xq = fp8_round_trip(x.contiguous(), act_block)           # each token's input quantised once
    if p <= combine_kernels.MAX_FUSED_PAIRS and cfg_down["BM"] == cfg_up["BM"]:
        # decode: the sort, the tile table and the sorted rows' tokens and weights in one launch
        token, route, inverse, tiles = combine_kernels.route(ids, weights, n_experts, cfg_up["BM"])
        tiles_down = tiles
    else:
        sort = sort_by_expert(ids, n_experts)
        token, inverse = sort.token.int(), sort.inverse
        route = weights.reshape(-1)[sort.order].float().contiguous()
        tiles = expert_tiles(sort, cfg_up["BM"])
        tiles_down = tiles if cfg_down["BM"] == cfg_up["BM"] else expert_tiles(sort, cfg_down["BM"])
    h = kernels.grouped_fp4(xq, token, tiles, (tables.w1, tables.s1), tables.inter, out_dtype,
                            w3=(tables.w3, tables.s3), route=route, limit=limit, config=cfg_up, shift=shift)
    out = kernels.grouped_fp4(fp8_round_trip(h, act_block), None, tiles_down, (tables.w2, tables.s2), tables.dim,
                              out_dtype, config=cfg_down, shift=shift)
    return combine_kernels.combine(out, inverse, ids, plus, result_dtype)


# Widening pays once the experts average enough rows. H200, V4-Flash's width, 16K tokens in 8192-token
# chunks (192 rows an expert): a widened expert cost 37 µs (its bf16 bytes written, then read by
# the GEMM), a row 0.12 µs in the grouped GEMM against 0.335 µs in the grouped FP4 kernel; the
# MoE's device time 244 against 263 ms, but the wall time no better (then the host read the counts
# with nothing queued behind them, once a layer). From 384 rows an expert (16K-token chunks) the
# same costs give 1.5×. `HYBRIDKV_FP4_WIDEN_MIN_ROWS` overrides it (benchmarks).
WIDEN_MIN_ROWS_PER_EXPERT = 384
WIDEN_SCRATCH_BYTES = 512 << 20        # the widened experts' scratch, at most (at least one expert)


def widen_ok(x: torch.Tensor, pairs: int, tables: ExpertTables, out_dtype: torch.dtype) -> bool:
    """Whether `routed_experts_fp4` widens the experts (`routed_experts_widened`): prefill-sized
    launches (`WIDEN_MIN_ROWS_PER_EXPERT` pairs an expert or more) in bf16 on CUDA of stacked experts,
    outside CUDA-graph capture (it reads the per-expert counts on the host), where torch has its
    grouped GEMM; `HYBRIDKV_FP4_WIDEN=0` keeps the grouped FP4 kernel's tiles (a benchmark baseline)."""
    min_rows = int(os.environ.get("HYBRIDKV_FP4_WIDEN_MIN_ROWS", WIDEN_MIN_ROWS_PER_EXPERT))
    return (x.is_cuda and pairs >= min_rows * tables.w1.shape[0] and out_dtype == torch.bfloat16
            and tables.stacked
            and hasattr(torch, "_grouped_mm") and os.environ.get("HYBRIDKV_FP4_WIDEN", "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def routed_experts_widened(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, tables: ExpertTables,
                           limit: float, plus: torch.Tensor | Callable | None = None,
                           result_dtype: torch.dtype = torch.float32,
                           scratch_bytes: int = WIDEN_SCRATCH_BYTES, act_block: int = ACT_BLOCK) -> torch.Tensor:
    """`routed_experts_fp4` for prefill, in bf16: the experts that have tokens, a group at a time
    (as many as `scratch_bytes` holds widened), widened to bf16 (`fp4_widen`), then per group one
    grouped GEMM for w1 and w3 side by side, the SwiGLU times the routing weight, the FP8 round trip
    and one grouped GEMM for w2. One host synchronisation (the experts' row offsets; a callable
    `plus` is launched before the host waits for them, so the device has work meanwhile). The same
    definition as the FP4 kernels: each projection's output rounded to bf16, activations through
    their FP8 round trip per `act_block` values; only the accumulation order differs."""
    from hybridkv.ops.grouped_moe import triton as combine_kernels
    from hybridkv.ops.qgemm.fp4_widen import widen_experts
    from hybridkv.ops.quant.triton import fp8_round_trip
    n_experts, dim, inter = tables.w1.shape[0], tables.dim, tables.inter
    sort = sort_by_expert(ids, n_experts)
    host = torch.empty(n_experts + 1, dtype=torch.int64, pin_memory=x.is_cuda)
    host.copy_(sort.offsets, non_blocking=True)
    arrived = torch.cuda.Event() if x.is_cuda else None
    if arrived is not None:
        arrived.record()
    if callable(plus):
        plus = plus()
    xq = fp8_round_trip(x.contiguous().to(torch.bfloat16), act_block)
    route = weights.reshape(-1)[sort.order].float()
    if arrived is not None:
        arrived.synchronize()          # the device still has the work queued above
    offsets = host.tolist()
    chosen = [e for e in range(n_experts) if offsets[e + 1] > offsets[e]]
    chosen_dev = torch.tensor(chosen, dtype=torch.int64, pin_memory=x.is_cuda).to(x.device, non_blocking=True)
    per_expert = 3 * inter * dim * 2                         # w1, w3 and w2 widened, bytes
    group = max(1, min(len(chosen), scratch_bytes // per_expert))
    out = torch.empty(ids.numel(), dim, dtype=torch.bfloat16, device=x.device)
    up_buf = torch.empty(group * 2 * inter * dim, dtype=torch.bfloat16, device=x.device)
    down_buf = torch.empty(group * dim * inter, dtype=torch.bfloat16, device=x.device)
    for g0 in range(0, len(chosen), group):
        experts = chosen[g0:g0 + group]
        lo, hi = offsets[experts[0]], offsets[experts[-1] + 1]     # their rows: contiguous in expert order
        ids_dev = chosen_dev[g0:g0 + group]
        ends = (sort.offsets[ids_dev + 1] - lo).int()            # each expert's last row + 1, in the group
        w13 = widen_experts(tables.w1, tables.s1, ids_dev, up_buf, second=(tables.w3, tables.s3))
        rows = xq.index_select(0, sort.token[lo:hi])
        gate_up = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=ends)
        h = swiglu(gate_up[:, :inter], gate_up[:, inter:], limit, route[lo:hi, None], torch.bfloat16)
        w2 = widen_experts(tables.w2, tables.s2, ids_dev, down_buf)
        out[lo:hi] = torch._grouped_mm(fp8_round_trip(h, act_block), w2.transpose(-2, -1), offs=ends)
    return combine_kernels.combine(out, sort.inverse, ids, plus, result_dtype)


def gate_kernel_ok(scores: torch.Tensor, score_func: str) -> bool:
    """Whether the gate's selection runs as one `gate_select` launch: a sqrt-softplus gate (V4's and
    V4.1's) in a forward without autograd, where the Triton kernels run."""
    return (score_func == "sqrtsoftplus" and use_triton(scores)
            and not (torch.is_grad_enabled() and scores.requires_grad))


def gate_select(scores: torch.Tensor, bias: torch.Tensor | None, topk: int, route_scale: float, norm: bool,
                tid2eid: torch.Tensor | None = None, input_ids: torch.Tensor | None = None, temp: float = 1.0,
                norm_eps: float = 0.0):
    """The gate after its logits, in one launch: sqrt(softplus(scores / temp)) [T, E]; the top `topk`
    of score + bias (or, on hash layers, tid2eid[input_ids]); their scores, normalised (`norm`: over
    their sum + norm_eps), times route_scale -> (weights [T, k] float32, ids [T, k] int64). The same
    selection as `Gate.forward`'s torch operations (ties: the lower expert id first); V4.1's gate is
    V4's with its temperature and norm_eps = 1e-20."""
    from hybridkv.ops.grouped_moe import triton as kernels
    return kernels.gate_select(scores, bias, topk, route_scale, norm, tid2eid, input_ids, temp, norm_eps)


def swiglu_kernel_ok(gate: torch.Tensor) -> bool:
    """Whether `swiglu` runs as one launch: where the Triton kernels run, without autograd."""
    return (use_triton(gate) and not (torch.is_grad_enabled() and gate.requires_grad)
            and gate.dtype in (torch.float32, torch.bfloat16))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None,
           out_dtype: torch.dtype) -> torch.Tensor:
    """An expert's activation in one launch: silu(min(gate, limit)) · clamp(up, ±limit) (limit 0:
    no clamps), times the routing weight [T, 1] if given, in float32, cast to out_dtype: `Expert`'s
    torch operations. gate/up [..., I] (may be column slices of one GEMM's output)."""
    from hybridkv.ops.grouped_moe import triton as kernels
    return kernels.swiglu(gate, up, limit, weights, out_dtype)
