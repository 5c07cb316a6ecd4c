"""One transformer block: attention and MoE sub-blocks, each wrapped in an mHC site (V4: `forward`;
V4.1's single-pass mHC: `forward_single_pass`)."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.distributed.group import SINGLE, Parallel
from hybridkv.model.attention import Attention
from hybridkv.model.csa2 import CrossLayerShare
from hybridkv.model.mhc import hc_mixes_collapse, hc_post, hc_pre
from hybridkv.model.moe import MoE
from hybridkv.model.norm import RMSNorm
from hybridkv.model.state import ForwardBatch


def _f32(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, expert_fmt: str, dtype: torch.dtype,
                 parallel: Parallel = SINGLE):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.hc_iters, self.hc_eps, self.norm_eps = c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps
        self.attn = Attention(c, layer_id, fmt, dtype, parallel)
        self.ffn = MoE(c, layer_id, fmt, expert_fmt, dtype, parallel)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        mix, hc_dim = (2 + c.hc_mult) * c.hc_mult, c.hc_mult * c.hidden_size
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _f32(mix, hc_dim), _f32(mix), _f32(3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _f32(mix, hc_dim), _f32(mix), _f32(3)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, input_ids: torch.Tensor,
                own_input: bool = False) -> torch.Tensor:
        """x [T, hc, dim] -> [T, hc, dim]. `own_input`: the caller reads x no more, so the stream
        may be updated where it lies (a 16K-token prefill chunk's stream is 512 MiB at V4-Flash's
        width; without it the input and the attention's output stream are both live in the MoE)."""
        y, post, comb = hc_pre(x, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base, self.hc_iters,
                               self.hc_eps, self.norm_eps)
        x = hc_post(self.attn(self.attn_norm(y), batch), x, post, comb, over_residual=own_input)
        y, post, comb = hc_pre(x, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.hc_iters,
                               self.hc_eps, self.norm_eps)
        # x is this block's own from here (the attention's output stream, or the input it may own)
        return hc_post(self.ffn(self.ffn_norm(y), input_ids, batch.static), x, post, comb, over_residual=True)

    def forward_single_pass(self, x: torch.Tensor, pre: torch.Tensor, batch: ForwardBatch, input_ids: torch.Tensor,
                            share: CrossLayerShare, own_input: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """V4.1: (x [T, hc, dim], the previous sub-block's pre mix [T, hc]) -> (x', the FFN's pre mix
        for the next block). Each sub-block's own mixes give its post/comb and the next one's pre."""
        y, attn_pre, post, comb = hc_mixes_collapse(x, pre, self.hc_attn_fn, self.hc_attn_scale, self.hc_attn_base,
                                                    self.hc_iters, self.hc_eps, self.norm_eps)
        x = hc_post(self.attn(self.attn_norm(y), batch, share), x, post, comb, over_residual=own_input)
        y, ffn_pre, post, comb = hc_mixes_collapse(x, attn_pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
                                                   self.hc_iters, self.hc_eps, self.norm_eps)
        x = hc_post(self.ffn(self.ffn_norm(y), input_ids, batch.static), x, post, comb, over_residual=True)
        return x, ffn_pre
