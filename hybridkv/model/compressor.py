"""KV compressor: turns every `ratio` tokens into one compressed entry by gated softmax pooling.

Handles any chunking of the token stream: tokens of an incomplete block wait in the request's
`CompressorState` and are pooled when their block completes, exactly as the reference's decode
path does; a chunk that completes many blocks pools them all at once, as its prefill path does.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import KV_FP8_BLOCK, ModelConfig
from hybridkv.model.linear import Linear
from hybridkv.model.norm import RMSNorm
from hybridkv.model.state import CompressorState
from hybridkv.ops.compress import pool_blocks, pool_each
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip
from hybridkv.ops.rope import apply_rope, rope_freqs


class Compressor(nn.Module):
    def __init__(self, config: ModelConfig, ratio: int, head_dim: int, rotate: bool, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim, self.rotate = ratio, head_dim, rotate
        self.overlap = ratio == 4
        self.rope_dim = config.qk_rope_head_dim
        coff = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32))
        self.wkv = Linear(config.hidden_size, coff * head_dim, "float", torch.float32)
        self.wgate = Linear(config.hidden_size, coff * head_dim, "float", torch.float32)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.out_dtype = dtype
        self.kv_pow2 = config.kv_pow2_scales

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows for the state: kv [T, coff·d] and score + ape [T, coff·d], float32."""
        x = x.float()
        return self.wkv(x), self.wgate(x) + self.ape[positions % self.ratio]

    def update(self, state: CompressorState, kv: torch.Tensor, score: torch.Tensor, start_pos: int,
               inv_freq: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Feed one request's rows for positions [start_pos, start_pos + len(kv)).
        Returns (index of the first new entry, new entries [n, d]); n may be 0."""
        r = self.ratio
        end_pos = start_pos + kv.shape[0]
        first_block = start_pos // r
        cur = r if self.overlap else 0  # row offset of the current block inside the state
        pending = start_pos - first_block * r
        rows_kv = torch.cat([state.kv[cur:cur + pending], kv.float()])
        rows_score = torch.cat([state.score[cur:cur + pending], score.float()])
        n_done = end_pos // r - first_block
        entries = rows_kv.new_zeros(0, self.head_dim)
        if n_done > 0:
            blocks_kv = rows_kv[: n_done * r].unflatten(0, (n_done, r))
            blocks_score = rows_score[: n_done * r].unflatten(0, (n_done, r))
            pooled = pool_blocks(blocks_kv, blocks_score, self.overlap, state.kv[:r], state.score[:r])
            if self.overlap:
                state.kv[:r] = blocks_kv[-1]
                state.score[:r] = blocks_score[-1]
            entries = self._finish(pooled, torch.arange(first_block, first_block + n_done, device=kv.device) * r,
                                   inv_freq)
        rest = rows_kv.shape[0] - n_done * r
        state.kv[cur:cur + rest] = rows_kv[n_done * r:]
        state.score[cur:cur + rest] = rows_score[n_done * r:]
        state.kv[cur + rest:cur + r] = 0
        state.score[cur + rest:cur + r] = float("-inf")
        return first_block, entries

    def update_decode(self, st_kv: torch.Tensor, st_score: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                      positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per request, batched: st_kv/st_score [B, rows, width] are the requests' states
        (updated in place). Returns (indices of the requests that completed a block, their entries)."""
        r = self.ratio
        cur = r if self.overlap else 0
        b = torch.arange(kv.shape[0], device=kv.device)
        st_kv[b, cur + positions % r] = kv.float()
        st_score[b, cur + positions % r] = score.float()
        sel = ((positions + 1) % r == 0).nonzero().squeeze(1)
        if sel.numel() == 0:
            return sel, kv.new_zeros(0, self.head_dim)
        skv, ssc = st_kv[sel], st_score[sel]
        pooled = pool_each(skv[:, cur:], ssc[:, cur:], self.overlap, skv[:, :r], ssc[:, :r])
        if self.overlap:
            st_kv[sel, :r] = skv[:, r:]
            st_score[sel, :r] = ssc[:, r:]
        st_kv[sel, cur:cur + r] = 0
        st_score[sel, cur:cur + r] = float("-inf")
        return sel, self._finish(pooled, positions[sel] + 1 - r, inv_freq)

    def _finish(self, pooled: torch.Tensor, block_starts: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """RMSNorm, RoPE at the block's first position, then the storage round trip."""
        c = self.norm(pooled.to(self.out_dtype))
        c = apply_rope(c, rope_freqs(block_starts, inv_freq))
        if self.rotate:
            return fp4_round_trip(hadamard_transform(c), 32)
        nope = fp8_round_trip(c[..., : -self.rope_dim], KV_FP8_BLOCK, self.kv_pow2)
        return torch.cat([nope, c[..., -self.rope_dim:]], dim=-1)
