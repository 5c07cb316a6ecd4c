"""Mixture of experts: sqrt-softplus gate with an aux-loss-free selection bias (or a fixed
token-id → experts table on hash layers), routed SwiGLU experts with clamping, one shared expert.
V4.1's gate divides the logits by `gate_temp` and normalises the weights with a 1e-20 guard; a
multimodal V4.1 checkpoint also carries `bias_vl`, the selection bias of image tokens (the text
path never uses it).

Routed experts run three ways: with the grouped kernels on (FP4 experts; on CUDA unless
`HYBRIDKV_GROUPED_FP4=0`, see `grouped_moe.cuda_kernel_enabled`), two grouped launches over the
tokens sorted by expert that read the packed weights (no host synchronisation, so also inside the
decode CUDA graph); otherwise each expert that has tokens over its rows (`_routed_by_expert`:
host-synchronising; the row-wise steps once over all pairs), or in captured forwards
`_routed_static` over dense expert weights.
Deterministic mode and `HYBRIDKV_DENSE_WEIGHTS=1` keep the dense paths on CUDA."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.distributed.group import SINGLE, Parallel
from hybridkv.distributed.sharding import expert_inter_part, expert_range, record_linear, shared_expert_part
from hybridkv.model.linear import Linear, pair_storage, paired_forward, widened_linear
from hybridkv.ops import grouped_moe
from hybridkv.ops.backend import is_deterministic


V41_NORM_EPS = 1e-20    # V4.1's gate divides its top-k weights by their sum plus this


class Gate(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int):
        super().__init__()
        self.topk, self.score_func, self.route_scale = (config.num_experts_per_tok, config.scoring_func,
                                                        config.routed_scaling_factor)
        self.norm_topk = config.norm_topk_prob
        self.v41 = config.family == "v4.1"
        # whether the top-k weights are divided by their sum (+ norm_eps): V4 unless it scores by
        # softmax, V4.1 when more than one expert is chosen
        self.normalise = self.norm_topk and (self.topk > 1 if self.v41 else self.score_func != "softmax")
        self.norm_eps = V41_NORM_EPS if self.v41 else 0.0
        self.temp = config.gate_temp
        self.hash = layer_id < config.num_hash_layers
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size, dtype=torch.float32))
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.topk, dtype=torch.int32))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))
        if self.v41 and config.multimodal:
            self.bias_vl = nn.Parameter(torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, dim] -> routing weights [T, k] (float32), expert ids [T, k]."""
        # float32 products and sums; at decode sizes one split-K launch that reads x as it is
        scores = widened_linear(x, self.weight, torch.float32)
        if grouped_moe.gate_kernel_ok(scores, self.score_func):
            # one launch for the activation, the selection, the gather and the normalisation
            return grouped_moe.gate_select(scores, self.bias, self.topk, self.route_scale, self.normalise,
                                           self.tid2eid if self.hash else None, input_ids if self.hash else None,
                                           temp=self.temp if self.v41 else 1.0, norm_eps=self.norm_eps)
        if self.v41:
            scores = scores / self.temp
        if self.score_func == "softmax":
            scores = scores.softmax(-1)
        elif self.score_func == "sigmoid":
            scores = scores.sigmoid()
        else:
            scores = F.softplus(scores).sqrt()
        if self.hash:
            ids = self.tid2eid[input_ids].long()
        else:
            ids = (scores + self.bias).topk(self.topk, dim=-1).indices
        w = scores.gather(1, ids)
        if self.normalise:
            w = w / (w.sum(-1, keepdim=True) + self.norm_eps)
        return w * self.route_scale, ids


class Expert(nn.Module):
    """SwiGLU with `up` clamped to [−limit, limit] and `gate` to ≤ limit; the routing weight is applied
    before w2."""

    def __init__(self, dim: int, inter: int, fmt: str, dtype: torch.dtype, block: tuple[int, int], limit: float,
                 paired: bool = False):
        super().__init__()
        self.w1 = Linear(dim, inter, fmt, dtype, block)
        self.w2 = Linear(inter, dim, fmt, dtype, block)
        self.w3 = Linear(dim, inter, fmt, dtype, block)
        self.limit = limit
        if paired:      # w1 and w3 in one buffer: one packed GEMM reads both
            pair_storage(self.w1, self.w3)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        gate, up = paired_forward(self.w1, self.w3, x)
        return self.w2(swiglu_rows(gate, up, self.limit, weights, x.dtype))


def swiglu_rows(gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """An expert's activation, row by row: silu(min(gate, limit)) · clamp(up, ±limit) (limit 0: no
    clamps), times the routing weight [T, 1] if given, in float32, cast to out_dtype. One launch
    where the Triton kernels run."""
    if grouped_moe.swiglu_kernel_ok(gate):
        return grouped_moe.swiglu(gate, up, limit, weights, out_dtype)
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    h = F.silu(gate) * up
    if weights is not None:
        h = weights * h
    return h.to(out_dtype)


_WARNED = False


def _warn_dense_experts() -> None:
    global _WARNED
    if not _WARNED:
        _WARNED = True
        warnings.warn("FP4 routed experts on CUDA run from dense bf16 copies (4x their packed bytes): "
                      "HYBRIDKV_GROUPED_FP4=0 turned the grouped FP4 kernels off", stacklevel=3)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, expert_fmt: str, dtype: torch.dtype,
                 parallel: Parallel = SINGLE):
        super().__init__()
        c = config
        self.n_experts = c.n_routed_experts
        self.parallel = parallel
        self.gate = Gate(c, layer_id)
        # several ranks (distributed/sharding.py): experts [e0, e1) whole, or every expert's width [i0, i1)
        e0, e1 = expert_range(c, parallel)
        i0, i1 = expert_inter_part(c, parallel, expert_fmt)
        self.expert_offset = e0
        self.experts = nn.ModuleList(
            Expert(c.hidden_size, i1 - i0, expert_fmt, dtype, c.fp8_block, c.swiglu_limit) for _ in range(e1 - e0))
        if i1 - i0 < c.moe_intermediate_size:
            for e in self.experts:
                record_linear(e.w1, 0, i0, i1)
                record_linear(e.w3, 0, i0, i1)
                record_linear(e.w2, 1, i0, i1)
        if expert_fmt == "fp4":   # one buffer per projection: the grouped kernels read experts by offset
            grouped_moe.stack_expert_storage([[e.w1, e.w3, e.w2] for e in self.experts])
        shared = shared_expert_part(c, parallel, fmt)
        self.shared_experts = None if shared is None else Expert(
            c.hidden_size, shared[1] - shared[0], fmt, dtype, c.fp8_block, c.swiglu_limit, paired=True)
        if shared is not None and shared[1] - shared[0] < c.moe_intermediate_size:
            for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
                record_linear(getattr(self.shared_experts, name), dim, *shared)
        self._stacked: tuple[tuple, tuple[torch.Tensor, ...]] | None = None
        self._tables: grouped_moe.ExpertTables | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, static: bool = False) -> torch.Tensor:
        """x [T, dim] -> [T, dim]. `static`: fixed shapes and no host synchronisation (a forward
        captured into a CUDA graph), see `_routed_static`."""
        weights, ids = self.gate(x, input_ids)
        par = self.parallel
        if par.ordered and not static:
            return self._routed_ordered(x, weights, ids)
        tables = self.expert_tables(x)
        if tables is not None:   # the shared expert's output added in the routed sum's last launch
            first = self.experts[0]
            shared = self.shared_experts
            # launched where it keeps the device busy while the host waits (prefill's widened experts)
            plus = (lambda: shared(x)) if shared is not None else None
            y = grouped_moe.routed_experts_fp4(x, *self._local_routing(weights, ids), tables, first.limit,
                                               first.w1.compute_dtype, plus=plus,
                                               result_dtype=x.dtype if par.single else torch.float32,
                                               act_block=first.w1.act_block)
            return y if par.single else par.all_reduce(y).to(x.dtype)
        if static:
            y = self._routed_static(x, *self._local_routing(weights, ids))
        else:
            y = self._routed_by_expert(x, weights, ids)
        if self.shared_experts is not None:
            y += self.shared_experts(x).float()
        return y.to(x.dtype) if par.single else par.all_reduce(y).to(x.dtype)

    def _routed_by_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum, float32 [T, dim]: each of this rank's experts that has tokens runs
        once over its rows (one host synchronisation for the counts). Where the experts' linears
        run on their dense weights, what does not depend on the expert runs once over every (token,
        expert) pair — the input's FP8 quantisation, the SwiGLU, the quantisation of its output —
        and each expert adds only its GEMMs: the per-expert loop's numbers bit for bit (those steps
        are row-wise, each GEMM sees the rows it saw, and `combine` adds in the loop's order),
        without the thirty-odd small operations per expert that bound a decode step on the CPU."""
        e0, first = self.expert_offset, self.experts[0]
        if not (first.w1.gemm_on_dense(x) and first.w3.gemm_on_dense(x) and first.w2.gemm_on_dense(x)):
            y = torch.zeros_like(x, dtype=torch.float32)
            counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
            for e in range(e0, e0 + len(self.experts)):
                if counts[e]:
                    rows, slot = torch.where(ids == e)   # rows are unique per expert
                    y[rows] += self.experts[e - e0](x[rows], weights[rows, slot, None]).float()
            return y
        sort = grouped_moe.sort_by_expert(ids, self.n_experts)
        offsets = sort.offsets.tolist()
        lo, hi = offsets[e0], offsets[e0 + len(self.experts)]     # this rank's experts' rows
        if lo == hi:
            return torch.zeros_like(x, dtype=torch.float32)
        segments = [(e, offsets[e0 + e] - lo, offsets[e0 + e + 1] - lo) for e in range(len(self.experts))
                    if offsets[e0 + e] < offsets[e0 + e + 1]]
        xin = first.w1.prepare_input(x)[sort.token[lo:hi]]
        gate = torch.cat([F.linear(xin[a:b], self.experts[e].w1.dense_weight()) for e, a, b in segments])
        up = torch.cat([F.linear(xin[a:b], self.experts[e].w3.dense_weight()) for e, a, b in segments])
        h = first.w2.prepare_input(swiglu_rows(gate, up, first.limit, weights.reshape(-1)[sort.order[lo:hi], None],
                                               x.dtype))
        out = torch.cat([F.linear(h[a:b], self.experts[e].w2.dense_weight()) for e, a, b in segments]).float()
        if hi - lo < ids.numel():     # other ranks' pairs add zero here
            mine, out = out, out.new_zeros(ids.numel(), x.shape[-1])
            out[lo:hi] = mine
        return grouped_moe.combine(out, sort, ids)

    def _routed_ordered(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Expert parallel, bit-equal to one process: each (token, slot) pair's output from the rank
        holding its expert (the same rows as one process gives that expert), summed across ranks
        (each slot has one non-zero part, so exactly), then each token's slots added in expert order
        from zero and the shared expert last: the per-expert loop's additions."""
        t, k = ids.shape
        slots = torch.zeros(t, k, x.shape[-1], dtype=torch.float32, device=x.device)
        counts = torch.bincount(ids.flatten(), minlength=self.n_experts).tolist()
        e0 = self.expert_offset
        for e in range(e0, e0 + len(self.experts)):
            if counts[e]:
                rows, slot = torch.where(ids == e)
                slots[rows, slot] = self.experts[e - e0](x[rows], weights[rows, slot, None]).float()
        slots = self.parallel.all_reduce(slots)
        order = ids.argsort(dim=1, stable=True)
        y = torch.zeros(t, x.shape[-1], dtype=torch.float32, device=x.device)
        for j in range(k):
            y += slots.gather(1, order[:, j, None, None].expand(t, 1, x.shape[-1])).squeeze(1)
        y += self.shared_experts(x).float()
        return y.to(x.dtype)

    def _local_routing(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, ids) over this rank's experts: ids made local, and the pairs of other ranks'
        experts sent to local expert 0 with weight 0 (they add nothing; at decode they ride in that
        expert's row tiles, whose weights are read anyway). The identity on a single rank."""
        if len(self.experts) == self.n_experts:
            return weights, ids
        local = ids - self.expert_offset
        mine = (local >= 0) & (local < len(self.experts))
        return torch.where(mine, weights, torch.zeros_like(weights)), torch.where(mine, local, torch.zeros_like(local))

    def _routed_static(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum without per-expert token lists. Few (token, expert) pairs: each
        pair's expert weights are gathered and applied as a batched matrix-vector product (reads only
        the selected experts). Many pairs, and always in deterministic mode (one arithmetic whatever
        the batch): every expert runs over every token as one GEMM per projection, pairs that were not
        routed weigh 0, and w2 sums over the experts inside its GEMM (in deterministic mode: per
        expert, added as `_routed_by_expert` adds, `_expert_order_sum`). Float32 [T, dim]."""
        w1, w3, w2 = self.stacked_weights()      # [E·inter, dim] ×2, [dim, E·inter]
        first = self.experts[0]
        n, inter = len(self.experts), first.w1.out_features
        xin = first.w1.prepare_input(x)          # w1 and w3 read the same (quantised) input
        t, k = ids.shape
        if 3 * t * k < n and not is_deterministic():
            flat = ids.flatten()
            xs = xin.repeat_interleave(k, 0).unsqueeze(-1)                              # [T·k, dim, 1]
            gate = torch.bmm(w1.view(n, inter, -1)[flat], xs).squeeze(-1)               # [T·k, inter]
            up = torch.bmm(w3.view(n, inter, -1)[flat], xs).squeeze(-1)
            h = first.w2.prepare_input(swiglu_rows(gate, up, first.limit, weights.reshape(-1, 1), x.dtype))
            w2e = w2.view(w2.shape[0], n, inter).transpose(0, 1)[flat]                  # [T·k, dim, inter]
            return torch.bmm(w2e, h.unsqueeze(-1)).squeeze(-1).float().view(t, k, -1).sum(1)
        # (adds: under expert parallelism several zero-weight pairs share local expert 0)
        route = torch.zeros(t, n, dtype=weights.dtype, device=x.device).scatter_add_(1, ids, weights)
        # each projection's output in x's dtype and the SwiGLU of `swiglu_rows`, as `_routed_by_expert`
        h = swiglu_rows(F.linear(xin, w1).view(t * n, inter), F.linear(xin, w3).view(t * n, inter), first.limit,
                        route.view(t * n, 1), x.dtype)
        h = first.w2.prepare_input(h).view(t, n, inter)
        if not is_deterministic():
            return F.linear(h.flatten(1), w2).float()          # w2 sums over the experts inside its GEMM
        return self._expert_order_sum(h, w2, ids)

    def _expert_order_sum(self, h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Deterministic mode: w2 of every expert over every token, each output in h's dtype, then
        each token's chosen experts added in expert order from zero in float32 — the arithmetic of
        `_routed_by_expert` and `grouped_moe.combine`, so that a decode row captured in a CUDA graph
        and the same row run eagerly (a verify wave, a step beside a prefill chunk) agree to the bit
        where the GEMMs are batch-invariant. h [T, E, inter] -> float32 [T, dim]."""
        t, n, inter = h.shape
        per = torch.bmm(h.transpose(0, 1), w2.view(w2.shape[0], n, inter).permute(1, 2, 0))   # [E, T, dim]
        order = ids.sort(dim=1).values
        tokens = torch.arange(t, device=h.device)
        y = torch.zeros(t, w2.shape[0], dtype=torch.float32, device=h.device)
        for j in range(ids.shape[1]):
            part = per[order[:, j], tokens].float()
            if j:   # an expert once (expert parallelism's zero-weight copies of local expert 0)
                part = part * (order[:, j] != order[:, j - 1]).unsqueeze(-1)
            y = y + part
        return y

    def expert_tables(self, x: torch.Tensor) -> grouped_moe.ExpertTables | None:
        """The grouped kernels' per-expert weight addresses when they run for x (FP4 experts on
        CUDA, not deterministic, not forced dense), else None. Built on first use and rebuilt when
        the parameters move."""
        first = self.experts[0]
        if first.w1.fmt == "fp4" and x.is_cuda and not grouped_moe.cuda_kernel_enabled():
            _warn_dense_experts()
        if (first.w1.fmt != "fp4" or is_deterministic()
                or not grouped_moe.grouped_kernel_ok(x, first.w1.act_block, first.w1.in_features,
                                                     first.w1.out_features)):
            return None
        ends = [[(getattr(e, w).weight, getattr(e, w).scale) for e in (first, self.experts[-1])]
                for w in ("w1", "w3", "w2")]
        if self._tables is None or self._tables.key != grouped_moe.table_key(ends):
            projections = [[(getattr(e, w).weight, getattr(e, w).scale) for e in self.experts]
                           for w in ("w1", "w3", "w2")]
            self._tables = grouped_moe.expert_tables(*projections)
        return self._tables

    def stacked_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed experts' dense weights side by side, built once: w1 and w3 as [E·inter, dim]
        (expert e's rows at e·inter), w2 as [dim, E·inter] (its columns there). For quantised experts
        each expert's dense cache then becomes a view of these (no second copy); float experts keep
        their own parameters beside them."""
        linears = [[e.w1, e.w3, e.w2] for e in self.experts]
        key = tuple((lin.weight.data_ptr(), lin.weight._version) for row in linears for lin in row)
        if self._stacked is None or self._stacked[0] != key:
            w1 = torch.cat([row[0].dense_weight() for row in linears])
            w3 = torch.cat([row[1].dense_weight() for row in linears])
            w2 = torch.cat([row[2].dense_weight() for row in linears], dim=1)
            inter = linears[0][0].out_features
            for e, row in enumerate(linears):
                part = slice(e * inter, (e + 1) * inter)
                for lin, view in zip(row, (w1[part], w3[part], w2[:, part])):
                    if lin.fmt != "float":
                        lin._dense = (lin._dense[0], view)
            self._stacked = (key, (w1, w3, w2))
        return self._stacked[1]
