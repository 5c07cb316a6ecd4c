"""Linear layers in the release's weight formats.

- "float": a dense weight [out, in] in the model's float dtype.
- "fp8":   e4m3 weight [out, in] + e8m0 scale per (block_out × block_in) tile; the input is
           quantised to e4m3 per `block_in` values with power-of-two scales before the GEMM.
- "fp4":   E2M1 pairs packed in int8 [out, in/2] (low nibble = even element) + e8m0 scale per 32
           inputs; the input is FP8-quantised per `act_block` values as for fp8.
- "fp8_exact": a "float" weight that holds FP8 values (the release's `wo_a`, which its conversion
           widened to bf16), stored back as e4m3 + e8m0 per 128×128 by `compact_exact_fp8` on CUDA;
           the input is not quantised: the numbers are the float weight's (`ops.qgemm.fp8_exact`).
On CUDA, FP8 weights with square blocks of 32, 64 or 128 run through GEMMs that read the e4m3 weight
itself (`hybridkv.ops.qgemm`) and FP4 experts through the MoE's grouped kernels: no dense copy is
made. Elsewhere (the CPU, other block sizes, `HYBRIDKV_DENSE_WEIGHTS=1`) the weight is dequantised
(exactly) once and cached; the activation quantisation is applied all the same, so the numerics
equal the reference's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.ops.backend import is_deterministic, use_triton
from hybridkv.ops.qgemm import fp8_kernel_ok, packed_fp8_linear, widened_rows_ok
from hybridkv.ops.quant import act_quant_sim, dequant_fp4_weight, dequant_fp8_weight

FORMATS = ("float", "fp8", "fp4")
FP4_WEIGHT_BLOCK = 32


def widened_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x · weightᵀ with float32 products and sums, in out_dtype, for a weight stored narrower than
    the arithmetic (a float32 weight the checkpoint holds in bf16: the head, the compressors'
    projections). On CUDA with x in the weight's dtype that is one GEMM with a float32 output:
    bf16 × bf16 products are exact in float32, so it computes what widening both operands would,
    without a float32 copy of the weight at every step; at decode sizes it is one Triton launch
    (`hybridkv.ops.qgemm.float_rows`, which also takes a float32 weight with a narrower input).
    Elsewhere (and in deterministic mode, whose GEMMs are batch-invariant) both are widened."""
    x2 = x.reshape(-1, x.shape[-1])
    if widened_rows_ok(x2, weight):    # few rows (decode): one launch, split over K
        from hybridkv.ops.qgemm.float_rows import rows_linear
        y = rows_linear(x2, weight).view(*x.shape[:-1], -1)
    elif (x.is_cuda and x.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)
            and not is_deterministic() and not torch.is_grad_enabled()):
        y = torch.mm(x2, weight.t(), out_dtype=torch.float32).view(*x.shape[:-1], -1)
    else:
        y = F.linear(x.to(torch.float32), weight.to(torch.float32))
    return y if y.dtype == out_dtype else y.to(out_dtype)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: str = "float", dtype: torch.dtype = torch.float32,
                 block: tuple[int, int] = (128, 128)):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}")
        self.in_features, self.out_features, self.fmt, self.block = in_features, out_features, fmt, tuple(block)
        self.compute_dtype = dtype
        if fmt == "float":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            self.register_parameter("scale", None)
        elif fmt == "fp8":
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                       requires_grad=False)
            sb = (-(-out_features // block[0]), -(-in_features // block[1]))
            self.scale = nn.Parameter(torch.empty(sb, dtype=torch.float8_e8m0fnu), requires_grad=False)
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.int8),
                                       requires_grad=False)
            self.scale = nn.Parameter(torch.empty(out_features, in_features // FP4_WEIGHT_BLOCK,
                                                  dtype=torch.float8_e8m0fnu), requires_grad=False)
        self._dense: tuple[tuple, torch.Tensor] | None = None

    @property
    def act_block(self) -> int:
        return self.block[1]

    def compact_exact_fp8(self) -> bool:
        """A "float" weight whose values are all FP8 with power-of-two 128×128 block scales is stored
        as such ("fp8_exact": half of bf16's bytes, the same numbers); returns whether it was."""
        from hybridkv.ops.qgemm.fp8_exact import BLOCK, exact_fp8
        if self.fmt != "float" or self.compute_dtype not in (torch.bfloat16, torch.float16):
            return False
        with torch.no_grad():
            packed = exact_fp8(self.weight)
        if packed is None:
            return False
        self.weight = nn.Parameter(packed[0], requires_grad=False)
        self.scale = nn.Parameter(packed[1], requires_grad=False)
        self.fmt, self.block = "fp8_exact", (BLOCK, BLOCK)
        return True

    def dense_weight(self) -> torch.Tensor:
        """The weight as a dense [out, in] tensor of the compute dtype (cached for quantised formats;
        made for the call for "fp8_exact", whose point is to hold no dense copy)."""
        if self.fmt == "float":
            return self.weight
        if self.fmt == "fp8_exact":
            return dequant_fp8_weight(self.weight, self.scale, self.block, self.compute_dtype)
        key = (self.weight.data_ptr(), self.weight._version, self.scale._version, self.weight.device)
        if self._dense is None or self._dense[0] != key:
            if self.fmt == "fp8":
                w = dequant_fp8_weight(self.weight, self.scale, self.block, self.compute_dtype)
            else:
                w = dequant_fp4_weight(self.weight, self.scale, FP4_WEIGHT_BLOCK, self.compute_dtype)
            self._dense = (key, w)
        return self._dense[1]

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the GEMM reads it: FP8-quantised per `act_block` inputs for the quantised formats, in
        the weight's dtype."""
        if self.fmt == "float":
            return x if x.dtype == self.weight.dtype else x.to(self.weight.dtype)
        if self.fmt == "fp8_exact":
            return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        x = act_quant_sim(x, self.act_block)
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

    def gemm_on_dense(self, x: torch.Tensor) -> bool:
        """Whether `forward(x)` is `F.linear(prepare_input(x), dense_weight())` in the compute dtype
        (no packed kernel, no widening): a caller may then prepare an input shared by several such
        linears once (the MoE's experts)."""
        if self.fmt == "float":
            return self.weight.dtype == self.compute_dtype
        if self.fmt == "fp8_exact":
            return True
        return not (self.fmt == "fp8" and fp8_kernel_ok(x, self.weight, self.block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemm_on_dense(x):
            if self.fmt == "float":
                return widened_linear(x, self.weight, self.compute_dtype)
            return packed_fp8_linear(x, self.weight, self.scale, self.compute_dtype, self.block[1])
        y = F.linear(self.prepare_input(x), self.dense_weight())
        return y if y.dtype == self.compute_dtype else y.to(self.compute_dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fmt={self.fmt}"


def grouped_output(x: torch.Tensor, linear: Linear, groups: int) -> torch.Tensor:
    """x [T, G, in] through the grouped projection `linear` (weight [G·R, in], rows g·R.. for group g,
    as V4's `wo_a`) -> [T, G, R] in x's dtype: the reference's einsum over the dense weight, or for an
    "fp8_exact" weight `fp8_exact.grouped_rows`, which reads the e4m3 weight itself."""
    if linear.fmt == "fp8_exact":
        from hybridkv.ops.qgemm.fp8_exact import grouped_rows
        return grouped_rows(x, linear.weight, linear.scale)
    w = linear.dense_weight().view(groups, -1, x.shape[-1])
    return torch.einsum("tgd,grd->tgr", x, w.to(x.dtype))


def pair_storage(first: Linear, second: Linear) -> bool:
    """Give two quantised linears of one input (a SwiGLU's w1 and w3) one buffer for their weights
    and one for their scales, `second`'s rows right after `first`'s, so that one GEMM can read both
    (`paired_weights`). Called where the linears are made (before loading): no second copy exists.
    Only where `first`'s rows fill whole scale tiles (else the pair's tiles would straddle both);
    returns whether they were paired."""
    if first.fmt != "fp8" or second.fmt != "fp8" or first.out_features % first.block[0] or \
            first.block != second.block or first.in_features != second.in_features:
        return False
    for attr in ("weight", "scale"):
        a, b = getattr(first, attr), getattr(second, attr)
        both = torch.empty((a.shape[0] + b.shape[0], *a.shape[1:]), dtype=a.dtype, device=a.device)
        setattr(first, attr, nn.Parameter(both[: a.shape[0]], requires_grad=False))
        setattr(second, attr, nn.Parameter(both[a.shape[0]:], requires_grad=False))
    return True


def _end_to_end(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view [ΣN, ...] over tensors that lie one right after another in one storage (each
    contiguous, of one dtype and row shape), else None."""
    first = tensors[0]
    at = first.data_ptr()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or t.data_ptr() != at
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        at += t.nbytes
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def paired_weights(first: Linear, second: Linear) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The [N1 + N2, ...] weight and scale views over two linears that `pair_storage` paired (and
    that still lie that way: moving a module moves each parameter alone), else None."""
    out = []
    for attr in ("weight", "scale"):
        a, b = getattr(first, attr, None), getattr(second, attr, None)
        view = None if a is None or b is None else _end_to_end([a, b])
        if view is None:
            return None
        out.append(view)
    return out[0], out[1]


def paired_forward(first: Linear, second: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first(x), second(x)): one packed FP8 GEMM over both where `pair_storage` paired them and the
    kernel runs (the outputs are column slices of its result), else the two linears."""
    pair = paired_weights(first, second)
    if pair is None or not fp8_kernel_ok(x, first.weight, first.block):
        return first(x), second(x)
    both = packed_fp8_linear(x, *pair, first.compute_dtype, first.block[1])
    return both[..., : first.out_features], both[..., first.out_features:]


def stack_storage(linears: list["Linear"]) -> bool:
    """Give float linears of one input one buffer for their weights, each one's rows right after the
    previous one's, so that one GEMM reads them all (`stacked_forward`): the compressors' and the
    indexer's projections of an attention layer. Their values are not kept: call it before the
    weights are loaded. Only for two or more "float" linears of one weight dtype, width and device;
    returns whether they were stacked."""
    if len(linears) < 2 or any(lin is None or lin.fmt != "float" for lin in linears):
        return False
    w0 = linears[0].weight
    if any(lin.weight.dtype != w0.dtype or lin.in_features != linears[0].in_features
           or lin.weight.device != w0.device for lin in linears):
        return False
    buf = torch.empty(sum(lin.out_features for lin in linears), linears[0].in_features, dtype=w0.dtype,
                      device=w0.device)
    at = 0
    for lin in linears:
        lin.weight = nn.Parameter(buf[at:at + lin.out_features], requires_grad=lin.weight.requires_grad)
        at += lin.out_features
    return True


def stacked_weight(linears: list["Linear"]) -> torch.Tensor | None:
    """The [ΣN, K] view over linears that `stack_storage` stacked (and that still lie that way), else None."""
    return _end_to_end([lin.weight for lin in linears])


def stacked_forward(linears: list["Linear"], x: torch.Tensor) -> list[torch.Tensor]:
    """[lin(x) for lin in linears]; on the GPU one GEMM with float32 products over the stacked
    weight (`stack_storage`), each output a column slice of its result in the linear's compute
    dtype. Elsewhere (the CPU's exact path, deterministic mode, training, unstacked weights) each
    linear runs alone."""
    w = stacked_weight(linears)
    if (w is None or not use_triton(x) or x.dtype not in (torch.bfloat16, torch.float16) or is_deterministic()
            or torch.is_grad_enabled()):
        return [lin(x) for lin in linears]
    y = widened_linear(x, w, torch.float32)
    out, at = [], 0
    for lin in linears:
        part = y[..., at:at + lin.out_features]
        out.append(part if lin.compute_dtype == torch.float32 else part.to(lin.compute_dtype))
        at += lin.out_features
    return out
