"""The compressor's pooling: a per-channel softmax over the tokens of a block.

    c_j = Σ_t softmax_t(score_t) ⊙ kv_t            (score already includes `ape`)

Non-overlapping (ratio 128, or any ratio ≠ 4): block j pools its own `ratio` tokens.
Overlapping (ratio 4, channel width 2d): block j pools 2·ratio rows — the previous block's tokens
through channels [0, d) and its own tokens through channels [d, 2d); the block before block 0 is
empty (kv 0, score −inf). Then each entry is finished: RMSNorm, RoPE at the block's first
position, and the storage round trip.
"""

from __future__ import annotations

import torch


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [n, L, D] -> [n, D]: softmax over L per channel, weighted sum."""
    return (kv * score.softmax(dim=1)).sum(dim=1)


def each_block_rows(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                    prev_score: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows each of n independent blocks pools: kv, score [n, ratio, C]; with overlap, prev_kv and
    prev_score [n, ratio, C] are the rows of the block before each one. Returns ([n, L, d], [n, L, d])."""
    if not overlap:
        return kv, score
    d = kv.shape[-1] // 2
    return (torch.cat([prev_kv[..., :d], kv[..., d:]], dim=1), torch.cat([prev_score[..., :d], score[..., d:]], dim=1))


def block_rows(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
               prev_score: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows each of n consecutive blocks of one request pools; prev_kv, prev_score [ratio, C] are
    the rows of the block before the first one (overlap only)."""
    if not overlap:
        return kv, score
    prevs_kv = torch.cat([prev_kv.unsqueeze(0), kv[:-1]], dim=0)
    prevs_score = torch.cat([prev_score.unsqueeze(0), score[:-1]], dim=0)
    return each_block_rows(kv, score, True, prevs_kv, prevs_score)


def pool_blocks(kv: torch.Tensor, score: torch.Tensor, overlap: bool,
                prev_kv: torch.Tensor | None = None, prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """Pool n consecutive complete blocks of one request: [n, ratio, C] -> [n, d]."""
    return softmax_pool(*block_rows(kv, score, overlap, prev_kv, prev_score))


def finish_entries(pooled: torch.Tensor, norm_weight: torch.Tensor, eps: float, freqs: torch.Tensor, kind: str,
                   out_dtype: torch.dtype, fp8_block: int = 64, pow2: bool = True) -> torch.Tensor:
    """RMSNorm, RoPE at each entry's first position (`freqs` [n, rope/2] complex), then the storage round
    trip: "main" FP8 on the nope dims (blocks of 64), "index" Hadamard + FP4 (blocks of 32)."""
    from hybridkv.ops.hadamard import hadamard_transform
    from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip
    from hybridkv.ops.rope import apply_rope
    x = pooled.to(out_dtype).float()
    c = (norm_weight * (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps))).to(out_dtype)
    c = apply_rope(c, freqs)
    if kind == "index":
        return fp4_round_trip(hadamard_transform(c), 32)
    rd = 2 * freqs.shape[-1]
    return torch.cat([fp8_round_trip(c[..., :-rd], fp8_block, pow2), c[..., -rd:]], dim=-1)
