"""Lightning Indexer of V4's CSA layers: scores the compressed entries for every query with a small
multi-head ReLU scorer over FP4-simulated, Hadamard-rotated queries and keys (from its own
overlapping compressor), and keeps the top-k. V4.1's indexer is `csa2.LatentIndexer`."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.model.compressor import Compressor
from hybridkv.model.linear import Linear
from hybridkv.ops.hadamard import rope_hadamard_fp4
from hybridkv.ops.indexer_topk import causal_topk, index_scores, indexer_topk


def random_scores(scores: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The random-selection ablation's scores: uniform noise where `scores` is finite, −inf (an
    invisible or excluded entry) kept, so a top-k over them is a random set among the same entries."""
    noise = torch.rand(scores.shape, generator=generator).to(scores.device)
    return noise.masked_fill(scores == float("-inf"), float("-inf"))


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk, self.ratio = (config.index_n_heads, config.index_head_dim,
                                                              config.index_topk, config.layer_ratio(layer_id))
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, fmt, dtype, config.fp8_block)
        self.weights_proj = Linear(config.hidden_size, self.n_heads, "float", dtype)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.compressor = Compressor(config, layer_id, self.head_dim, rotate=True, dtype=dtype)
        # An ablation, not a mode of the model: with a generator set, the indexer's scores are replaced
        # by uniform noise, so its top-k is a random set of the same size among the visible entries.
        self.random_selection: torch.Generator | None = None

    def ablate(self, scores: torch.Tensor) -> torch.Tensor:
        """scores unchanged, or uniform noise of the same shape under the random-selection ablation."""
        return scores if self.random_selection is None else random_scores(scores, self.random_selection)

    def queries(self, qr: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim]: RoPE on the last dims of each head, Hadamard, FP4 round trip."""
        return rope_hadamard_fp4(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), freqs)

    def head_weights(self, x: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head weights [T, heads]; `projected`: weights_proj(x) already computed."""
        return (self.weights_proj(x) if projected is None else projected) * self.weight_scale

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Top-k entry ids [T, k] (−1 = unused) among entries visible to each query."""
        visible = (positions + 1) // self.ratio
        if self.random_selection is not None:
            return causal_topk(self.ablate(index_scores(q, w, keys)), visible, self.topk)
        return indexer_topk(q, w, keys, visible, self.topk)
