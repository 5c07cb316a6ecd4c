"""KV compressor: turns every `ratio` tokens into one compressed entry by gated softmax pooling.

Handles any chunking of the token stream: tokens of an incomplete block wait in the request's
`CompressorState` and are pooled when their block completes, exactly as the reference's decode
path does; a chunk that completes many blocks pools them all at once, as its prefill path does.

Two variants, selected by the config's family:
- V4: a learned position bias `ape` on the gate logits; a CSA layer's compressor pools overlapping
  windows; the entry is normalised, RoPE'd at its block's first position and round-tripped for
  storage (FP8 nope dims for the main KV; Hadamard + FP4 for the indexer's keys).
- V4.1: non-overlapping, no `ape`; ratio 1 is `norm(wkv(x))` with no gate and no state. It returns
  the normalised latent *before* RoPE, because the indexer keys are derived from it; the attention
  layer applies RoPE and the FP4 storage round trip itself.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.config import ModelConfig
from hybridkv.model.linear import Linear
from hybridkv.model.norm import RMSNorm
from hybridkv.model.state import CompressorState
from hybridkv.ops.compress import block_rows, compress_entries, each_block_rows, softmax_pool
from hybridkv.ops.rope import rope_freqs


class Compressor(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, head_dim: int, rotate: bool, dtype: torch.dtype):
        super().__init__()
        ratio = config.layer_ratio(layer_id)
        self.ratio, self.head_dim, self.rotate = ratio, head_dim, rotate
        self.latent = config.family == "v4.1"
        self.overlap = config.layer_kind(layer_id) == "csa"
        self.rope_dim = config.qk_rope_head_dim
        coff = 2 if self.overlap else 1
        if self.latent:
            self.register_parameter("ape", None)
        else:
            self.ape = nn.Parameter(torch.empty(ratio, coff * head_dim, dtype=torch.float32))
        # ratio 1 projects each token in the model's dtype; pooling runs in float32
        self.wkv = Linear(config.hidden_size, coff * head_dim, "float", dtype if ratio == 1 else torch.float32)
        if self.latent and ratio == 1:
            self.register_module("wgate", None)
        else:
            self.wgate = Linear(config.hidden_size, coff * head_dim, "float", torch.float32)
        self.norm = RMSNorm(head_dim, config.rms_norm_eps)
        self.out_dtype = dtype
        self.kv_pow2 = config.kv_pow2_scales

    @property
    def stateless(self) -> bool:
        """True when every token is its own entry (V4.1 ratio 1): no pending-block state."""
        return self.wgate is None

    def project(self, x: torch.Tensor, positions: torch.Tensor, ape: bool = True,
                projected: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token rows: (kv [T, coff·d], score (+ ape) [T, coff·d]) in float32 for the state; for a
        stateless compressor (latent entries [T, d], None). ape=False leaves the position bias to
        the caller (a fused decode kernel adds it). `projected`: (wkv(x), wgate(x)) already computed
        (by one GEMM over the layer's stacked projections; a stateless one's gate None)."""
        if self.stateless:
            return self.norm(self.wkv(x) if projected is None else projected[0]), None
        if projected is not None:
            kv, score = projected
        else:
            kv, score = self.wkv(x), self.wgate(x)  # float32 weights (or bf16-stored ones): float32 products
        if self.ape is not None and ape:
            score = score + self.ape[positions % self.ratio]
        return kv, score

    def update(self, state: CompressorState | None, kv: torch.Tensor, score: torch.Tensor | None, start_pos: int,
               inv_freq: torch.Tensor, write=None) -> tuple[int, torch.Tensor | None]:
        """Feed one request's rows for positions [start_pos, start_pos + len(kv)).
        Returns (index of the first new entry, new entries [n, d]); n may be 0. With `write(rows,
        block_starts, requests)` the completed blocks' rows go there instead (a fused finish-and-store)
        and no entries are returned."""
        if self.stateless:
            return start_pos, kv
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
            rows = block_rows(blocks_kv, blocks_score, self.overlap, state.kv[:r], state.score[:r])
            if self.overlap:
                state.kv[:r] = blocks_kv[-1]
                state.score[:r] = blocks_score[-1]
            starts = torch.arange(first_block, first_block + n_done, device=kv.device) * r
            if write is not None:
                write(rows, starts, torch.zeros(n_done, dtype=torch.int32, device=kv.device))
                entries = None
            else:
                entries = self.finish(rows, starts, inv_freq)
        rest = rows_kv.shape[0] - n_done * r
        state.kv[cur:cur + rest] = rows_kv[n_done * r:]
        state.score[cur:cur + rest] = rows_score[n_done * r:]
        state.kv[cur + rest:cur + r] = 0
        state.score[cur + rest:cur + r] = float("-inf")
        return first_block, entries

    def update_decode(self, st_kv: torch.Tensor, st_score: torch.Tensor, kv: torch.Tensor, score: torch.Tensor,
                      positions: torch.Tensor, inv_freq: torch.Tensor,
                      write=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token per request, batched: st_kv/st_score [B, rows, width] are the requests' states
        (updated in place). Returns (indices of the requests that completed a block, their entries).
        With `write(rows, block_starts, requests, entry_ids)` every request's rows go there with fixed
        shapes, entry id −1 where no block completed (see `_complete_masked`), and (all requests, None)
        is returned."""
        r = self.ratio
        cur = r if self.overlap else 0
        b = torch.arange(kv.shape[0], device=kv.device)
        st_kv[b, cur + positions % r] = kv.float()
        st_score[b, cur + positions % r] = score.float()
        if write is not None:
            self._complete_masked(st_kv, st_score, positions, write)
            return b, None
        sel = ((positions + 1) % r == 0).nonzero().squeeze(1)
        if sel.numel() == 0:
            return sel, kv.new_zeros(0, self.head_dim)
        skv, ssc = st_kv[sel], st_score[sel]
        rows = each_block_rows(skv[:, cur:], ssc[:, cur:], self.overlap, skv[:, :r], ssc[:, :r])
        if self.overlap:
            st_kv[sel, :r] = skv[:, r:]
            st_score[sel, :r] = ssc[:, r:]
        st_kv[sel, cur:cur + r] = 0
        st_score[sel, cur:cur + r] = float("-inf")
        return sel, self.finish(rows, positions[sel] + 1 - r, inv_freq)

    def _complete_masked(self, st_kv: torch.Tensor, st_score: torch.Tensor, positions: torch.Tensor, write) -> None:
        """update_decode's block completion with fixed shapes and no host synchronisation: every
        request's rows go to `write`, those that complete no block with entry id −1 (not stored), and
        the states advance where a block completed."""
        r = self.ratio
        cur = r if self.overlap else 0
        done = ((positions + 1) % r == 0).view(-1, 1, 1)
        rows = each_block_rows(st_kv[:, cur:], st_score[:, cur:], self.overlap, st_kv[:, :r], st_score[:, :r])
        starts = positions + 1 - r
        write(rows, starts.clamp(min=0), torch.arange(positions.shape[0], dtype=torch.int32, device=positions.device),
              torch.where(done.view(-1), torch.div(starts, r, rounding_mode="floor"), -1))
        if self.overlap:
            st_kv[:, :r] = torch.where(done, st_kv[:, r:], st_kv[:, :r])
            st_score[:, :r] = torch.where(done, st_score[:, r:], st_score[:, :r])
        st_kv[:, cur:cur + r] = torch.where(done, 0.0, st_kv[:, cur:cur + r])
        st_score[:, cur:cur + r] = torch.where(done, float("-inf"), st_score[:, cur:cur + r])

    def finish(self, rows: tuple[torch.Tensor, torch.Tensor], block_starts: torch.Tensor,
               inv_freq: torch.Tensor) -> torch.Tensor:
        """Pool and RMSNorm; for V4 also RoPE at each block's first position and the storage round trip."""
        if self.latent:
            return self.norm(softmax_pool(*rows).to(self.out_dtype))
        return compress_entries(*rows, self.norm.weight, self.norm.eps, rope_freqs(block_starts, inv_freq),
                                "index" if self.rotate else "main", self.out_dtype, pow2=self.kv_pow2)
