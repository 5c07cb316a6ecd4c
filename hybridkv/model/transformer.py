"""The DeepSeek-V4 causal LM: embedding → hc-fold stream → blocks → hc head → norm → logits,
plus the MTP block(s) that predict the token after next from the last stream.

DeepSeek-V4.1 (selected by the config's family): the blocks run single-pass mHC and CSA2 layer
sharing; the stream is collapsed with the last FFN's mix instead of an hc head; the draft layers
(DSpark) are not built. `forward` returns what the LM head reads: the stream [T, hc, dim] for V4
(collapsed by the hc head in `logits`), the collapsed hidden [T, dim] for V4.1."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.distributed.group import SINGLE, Parallel
from hybridkv.distributed.sharding import record, vocab_part
from hybridkv.errors import ConfigError
from hybridkv.model import ced
from hybridkv.model.attention import Attention
from hybridkv.model.block import Block
from hybridkv.model.linear import Linear, widened_linear
from hybridkv.model.csa2 import CrossLayerShare
from hybridkv.model.mhc import hc_collapse, hc_head, identity_pre
from hybridkv.model.norm import RMSNorm
from hybridkv.model.vocab import VocabParallelEmbedding
from hybridkv.model.state import ForwardBatch


def _add_hc_head(module: nn.Module, hc: int, dim: int) -> None:
    """`hc_head_{fn,base,scale}`: the parameters that collapse the stream for the LM head."""
    module.hc_head_fn = nn.Parameter(torch.empty(hc, hc * dim, dtype=torch.float32))
    module.hc_head_base = nn.Parameter(torch.empty(hc, dtype=torch.float32))
    module.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))


class MTPBlock(Block):
    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, expert_fmt: str, dtype: torch.dtype,
                 parallel: Parallel = SINGLE):
        super().__init__(config, layer_id, fmt, expert_fmt, dtype, parallel)
        d = config.hidden_size
        self.e_proj = Linear(d, d, fmt, dtype, config.fp8_block)
        self.h_proj = Linear(d, d, fmt, dtype, config.fp8_block)
        self.enorm = RMSNorm(d, config.rms_norm_eps)
        self.hnorm = RMSNorm(d, config.rms_norm_eps)
        self.norm = RMSNorm(d, config.rms_norm_eps)
        _add_hc_head(self, config.hc_mult, d)


def weight_formats(config: ModelConfig) -> tuple[str, str]:
    """(format of the quantisable linears, format of the routed experts)."""
    fmt = "fp8" if config.quantized else "float"
    expert = {"fp4": "fp4", "fp8": "fp8", "bf16": "float", None: fmt}[config.expert_dtype]
    return fmt, expert


def head_logits(x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor | None = None) -> torch.Tensor:
    """float32 logits of x [N, dim] under the head weight [vocab, dim] (float32, or bf16 where the
    checkpoint stores it so: `hybridkv.weights.narrowable_float_weights`): the products of the weight's
    and x's values summed in float32 (`widened_linear`). `columns`: the weight's float32 transpose
    [dim, vocab] (`Transformer.head_columns`), which the CPU GEMM reads faster."""
    if columns is not None:
        return torch.mm(x.reshape(-1, x.shape[-1]).to(torch.float32), columns).view(*x.shape[:-1], -1)
    return widened_linear(x, weight, torch.float32)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, parallel: Parallel = SINGLE):
        """`parallel`: this process's rank in a sharded model (distributed/sharding.py: its heads,
        experts and vocabulary rows); the default is the whole model."""
        super().__init__()
        if config.family not in ("v4", "v4.1"):
            raise ConfigError(f"the {config.family} family cannot be instantiated by this model "
                              f"(model_type {config.model_type!r}); V3.2 is an accounting-only preset")
        if config.extra.get("engram_layer_ids"):
            raise ConfigError(f"engram_layer_ids {config.extra['engram_layer_ids']}: Engram memory layers are not "
                              f"implemented; use a config without them")
        c = self.config = config
        self.dtype = dtype
        self.last_ced: ced.CedPlan | None = None   # the last forward's CED plan (None: every row ran)
        self._head_columns: tuple[tuple, torch.Tensor] | None = None   # `head_columns`' cache
        self.single_pass = c.family == "v4.1"
        fmt, expert_fmt = weight_formats(c)
        self.parallel = parallel
        self.embed = (nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype) if parallel.single
                      else VocabParallelEmbedding(c.vocab_size, c.hidden_size, dtype, parallel))
        self.layers = nn.ModuleList(Block(c, i, fmt, expert_fmt, dtype, parallel) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        v0, v1, _ = vocab_part(c.vocab_size, parallel, head=True)
        self.head = nn.Linear(c.hidden_size, v1 - v0, bias=False, dtype=torch.float32)
        if v1 - v0 < c.vocab_size:
            record(self.head, "weight", (0, v0, v1))
        if self.single_pass:  # no hc head; V4.1's draft layers (DSpark) are out of scope
            self.mtp = nn.ModuleList()
            return
        _add_hc_head(self, c.hc_mult, c.hidden_size)
        self.mtp = nn.ModuleList(MTPBlock(c, c.num_hidden_layers + i, fmt, expert_fmt, dtype, parallel)
                                 for i in range(c.num_nextn_predict_layers))

    def stack_projections(self) -> int:
        """Stack every attention layer's per-token float projections in one buffer per layer
        (`Attention.stack_projections`), before the weights are loaded. Returns how many layers."""
        return sum(m.stack_projections() for m in self.modules() if isinstance(m, Attention))

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch,
                after_layer: Callable | None = None) -> torch.Tensor:
        """input_ids [T] (flat batch) -> what `logits` reads: the last block's stream [T, hc, dim]
        (V4) or its collapse [T, dim] (V4.1).

        `after_layer(i, h, pre)` is called after block i with its output stream and, for V4.1, the
        pre mix it hands to the next block (None for V4). It may return None, a stream for the next
        block to read instead (teacher forcing), or, for V4.1, a (stream, pre mix) pair. The return
        value is always computed from the last block's own output."""
        h = self.embed(input_ids).unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        pre = identity_pre(h) if self.single_pass else None
        share = CrossLayerShare()
        plan = ced.plan(self.config, batch) if self.single_pass and after_layer is None else None
        self.last_ced = plan
        for i, layer in enumerate(self.layers):
            if plan is not None and i == plan.source:
                # CED: the source's compressor over every row, the decoder over the plan's rows only
                x = layer.attn_norm(hc_collapse(h, pre))
                plan.comp = layer.attn.compress_rows(x, batch.positions)
                h, pre, input_ids = h[plan.rows], pre[plan.rows], input_ids[plan.rows]
                share = ced.remap_share(share, plan)
                batch = plan.batch
                batch.ced = plan
            # the stream is updated where it lies unless `after_layer` may keep a block's output
            own = after_layer is None
            if self.single_pass:
                h, pre = layer.forward_single_pass(h, pre, batch, input_ids, share, own_input=own)
            else:
                h = layer(h, batch, input_ids, own_input=own)
            out, out_pre = h, pre
            if after_layer is not None:
                replaced = after_layer(i, h, pre)
                if isinstance(replaced, tuple):
                    h, pre = replaced
                elif replaced is not None:
                    h = replaced
        if not self.single_pass:
            return out
        y = hc_collapse(out, out_pre)
        if plan is None:
            return y
        plan.comp = {}   # the compressor rows are spent; last_ced keeps only the plan's layout
        full = y.new_full((plan.full.num_tokens, y.shape[-1]), float("nan"))   # rows not computed: NaN
        full[plan.rows] = y
        return full

    def logits(self, h: torch.Tensor, owner: nn.Module | None = None) -> torch.Tensor:
        """Rows of `forward`'s output -> float32 logits [N, vocab]. V4: stream rows [N, hc, dim],
        collapsed by the hc head of `owner` (the model itself, or an MTP block); V4.1: [N, dim]."""
        if self.single_pass:
            return self._vocab_logits(self.norm(h))
        m = owner if owner is not None else self
        x = hc_head(h, m.hc_head_fn, m.hc_head_scale, m.hc_head_base, self.config.hc_eps, self.config.rms_norm_eps)
        return self._vocab_logits(m.norm(x))

    def head_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """The head weight's float32 transpose [dim, vocab], kept while the weight is unchanged, for
        inference on the CPU (else None): MKL reads a [vocab, dim] weight for one or two rows at a
        third of the speed it reads [dim, vocab] (tiny-v4's 4 MiB head from DRAM: 0.51 against 0.19 ms
        a row on a 2-core AMD EPYC). Rows round as another GEMM does."""
        w = self.head.weight
        if x.is_cuda or w.is_cuda or torch.is_grad_enabled() or not w.is_floating_point():
            return None
        key = (w.data_ptr(), w._version, w.dtype)
        if self._head_columns is None or self._head_columns[0] != key:
            self._head_columns = (key, w.detach().t().to(torch.float32).contiguous())
        return self._head_columns[1]

    def _vocab_logits(self, x: torch.Tensor) -> torch.Tensor:
        y = head_logits(x, self.head.weight, self.head_columns(x))
        if y.shape[-1] == self.config.vocab_size:
            return y
        _, _, chunk = vocab_part(self.config.vocab_size, self.parallel, head=True)   # each rank's columns, gathered
        if y.shape[-1] < chunk:
            y = torch.nn.functional.pad(y, (0, chunk - y.shape[-1]))
        return self.parallel.gather_columns(y, self.config.vocab_size)

    def mtp_forward(self, h: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch, depth: int = 0) -> torch.Tensor:
        """MTP block `depth` on stream rows h [T, hc, dim] and the ids of the following tokens
        (next_ids[i] = token at position i + 1) -> its output stream [T, hc, dim]."""
        m = self.mtp[depth]
        e = m.enorm(self.embed(next_ids))
        x = m.e_proj(e).unsqueeze(1) + m.h_proj(m.hnorm(h))
        return m(x, batch, next_ids)

    def mtp_logits(self, h_mtp: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.logits(h_mtp, self.mtp[depth])
