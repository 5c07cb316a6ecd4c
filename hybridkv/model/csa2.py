"""DeepSeek-V4.1 CSA2: compressed KV, indexer keys and top-k selections shared across layers.

Every compressed layer has a mode (`config.layer_kind`):
- full: its own compressor and indexer. The compressor's pre-RoPE latent gives both the indexer
  keys `k_norm(wk(latent))` (RoPE, FP4 in blocks of 32 with power-of-two scales) and the global
  KV (RoPE, FP4 in blocks of 16 with e4m3 scales); both are stored in the layer's own `LayerKV`.
  It computes its own top-k over its keys.
- reindex: an indexer query of its own over the last Full layer's keys, restricted to the
  candidate pool when a candidate source precedes it.
- reuse: the last Full layer's KV and the last indexer's (Full or Reindex) top-k.
The candidate source (a Full layer) scores blocks of entries and publishes the pool.

What persists across forwards (entries) lives in the request's `LayerKV`, read by later layers
through `kv.layer(config.kv_source(layer_id))`, so every step sees each source's current keys.
What a layer hands to the layers after it within one forward (top-k, pool) lives in a
`CrossLayerShare`, one entry per segment.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import FP4_BLOCK, V41_GLOBAL_FP4_BLOCK, ModelConfig
from hybridkv.model.indexer import random_scores
from hybridkv.model.linear import Linear
from hybridkv.model.norm import RMSNorm
from hybridkv.ops.indexer_topk import candidate_blocks, causal_topk, index_scores, mask_invisible
from hybridkv.ops.hadamard import rope_fp4


class CrossLayerShare:
    """Per-forward hand-off between layers, keyed by segment index: the last index source's top-k
    (entry ids, −1 = none) and the candidate source's pool (bool mask over entries)."""

    def __init__(self) -> None:
        self.topk: dict[int, torch.Tensor] = {}
        self.candidates: dict[int, torch.Tensor] = {}


SCORE_ELEMENTS = 1 << 27    # float32 products [rows, heads, entries] a prefill selection holds at once (512 MiB)


class LatentIndexer(nn.Module):
    """The V4.1 indexer of a Full or Reindex layer (release names `indexer.{wq_b, weights_proj}`,
    plus `indexer.{wk, k_norm}` on Full layers, which derive the keys)."""

    def __init__(self, config: ModelConfig, layer_id: int, fmt: str, dtype: torch.dtype):
        super().__init__()
        c = config
        self.n_heads, self.head_dim, self.topk = c.index_n_heads, c.index_head_dim, c.index_topk
        self.ratio = c.layer_ratio(layer_id)
        self.wq_b = Linear(c.q_lora_rank, self.n_heads * self.head_dim, fmt, dtype, c.fp8_block)
        self.weights_proj = Linear(c.hidden_size, self.n_heads, "float", dtype)
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        if c.layer_kind(layer_id) == "full":
            self.wk = Linear(c.head_dim, self.head_dim, "float", dtype)
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.is_candidate_source = layer_id == c.candidate_source_layer_id
        # the pool is built only where a later indexer takes its top-k inside it (an 8-layer cut of
        # V4.1-Flash keeps its candidate source and none of the Reindex layers that read the pool)
        self.publishes_pool = self.is_candidate_source and any(
            c.uses_candidates(i) for i in range(len(c.compress_ratios)))
        self.uses_candidates = c.uses_candidates(layer_id)
        self.pool_blocks, self.pool_block_size = c.candidate_topk_blocks, c.candidate_block_size
        # the ablation of `Indexer.random_selection`: with a generator set, the scores of the visible
        # entries are uniform noise, so the candidate pool and the top-k are random sets of their sizes
        self.random_selection: torch.Generator | None = None

    def queries(self, qr: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """[T, heads, head_dim]: RoPE on the last dims of each head, FP4 round trip (no Hadamard)."""
        return rope_fp4(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), freqs, FP4_BLOCK)

    def head_weights(self, x: torch.Tensor, projected: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head weights [T, heads]; `projected`: weights_proj(x) already computed."""
        return (self.weights_proj(x) if projected is None else projected) * self.weight_scale

    def keys(self, latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """Indexer keys of new entries from their pre-RoPE latents [n, head_dim of the model]."""
        return rope_fp4(self.k_norm(self.wk(latent)), freqs, FP4_BLOCK)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
               pool: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Top-k entry ids [T, k] in position order (−1 = unused), and the candidate pool this
        layer publishes (candidate source only). `pool` restricts the choice (Reindex layers)."""
        visible = torch.div(positions + 1, self.ratio, rounding_mode="floor")
        # rows in slices whose [rows, heads, N] float32 products stay within SCORE_ELEMENTS (a
        # prefill chunk of 8192 rows at 128K entries would need 137 GB at once); every step is row-wise
        step = max(1, SCORE_ELEMENTS // max(1, q.shape[1] * keys.shape[0]))
        parts = [self._choose(mask_invisible(index_scores(q[r], w[r], keys), visible[r]), visible[r],
                              None if pool is None else pool[r])
                 for r in (slice(a, a + step) for a in range(0, max(1, q.shape[0]), step))]
        if len(parts) == 1:
            return parts[0]
        ids, pools = zip(*parts)
        return torch.cat(ids), (None if pools[0] is None else torch.cat(pools))

    def select_batched(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor,
                       pool: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`select` for B requests that decode one token each: q [B, heads, d], w [B, heads], each
        request's own keys [B, N, d] (rows past its visible entries are ignored)."""
        visible = torch.div(positions + 1, self.ratio, rounding_mode="floor")
        scores = (torch.einsum("bhd,bnd->bhn", q.float(), keys.float()).relu_() * w.float().unsqueeze(-1)).sum(1)
        return self._choose(mask_invisible(scores, visible), visible, pool)

    def select_scored(self, scores: torch.Tensor, positions: torch.Tensor,
                      pool: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`select_batched` from scores the paged kernels computed over the stored keys
        (`indexer_topk.paged_scores`: [B, N], already −inf beyond each request's visible entries)."""
        return self._choose(scores, torch.div(positions + 1, self.ratio, rounding_mode="floor"), pool)

    def _choose(self, scores: torch.Tensor, visible: torch.Tensor,
                pool: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scores masked beyond `visible` -> (top-k ids in position order, the published candidate
        pool or None)."""
        if self.random_selection is not None:
            scores = random_scores(scores, self.random_selection)
        published = None
        if self.publishes_pool:
            published = candidate_blocks(scores, visible, self.pool_blocks, self.pool_block_size)
        elif pool is not None:
            scores = scores.masked_fill(~pool, float("-inf"))
        return causal_topk(scores, visible, self.topk, by_position=True, masked=True), published


def global_kv(latent: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """The stored form of new global KV entries: RoPE at the block's first position, then FP4 in
    blocks of 16 with e4m3 scales."""
    return rope_fp4(latent, freqs, V41_GLOBAL_FP4_BLOCK, "e4m3")
