"""The compressor's pooling: a per-channel softmax over the tokens of a block.

    c_j = Σ_t softmax_t(score_t) ⊙ kv_t            (score already includes `ape`)

Non-overlapping (ratio 128, or any ratio ≠ 4): block j pools its own `ratio` tokens.
Overlapping (ratio 4, channel width 2d): block j pools 2·ratio rows — the previous block's tokens
through channels [0, d) and its own tokens through channels [d, 2d); the block before block 0 is
empty (kv 0, score −inf).
"""

from __future__ import annotations

import torch


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [n, L, D] -> [n, D]: softmax over L per channel, weighted sum."""
    return (kv * score.softmax(dim=1)).sum(dim=1)


def pool_each(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
              prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """Pool n independent blocks: kv, score [n, ratio, C]; with overlap, prev_kv/prev_score
    [n, ratio, C] are the rows of the block before each one. Returns [n, d]."""
    if not overlap:
        return softmax_pool(kv, score)
    d = kv.shape[-1] // 2
    rows_kv = torch.cat([prev_kv[..., :d], kv[..., d:]], dim=1)
    rows_score = torch.cat([prev_score[..., :d], score[..., d:]], dim=1)
    return softmax_pool(rows_kv, rows_score)


def pool_blocks(kv: torch.Tensor, score: torch.Tensor, overlap: bool,
                prev_kv: torch.Tensor | None = None, prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """Pool n consecutive complete blocks of one request.

    kv, score: [n, ratio, C] token rows (C = 2d if overlap else d).
    prev_kv, prev_score: [ratio, C] rows of the block before the first one (overlap only).
    Returns [n, d].
    """
    if not overlap:
        return pool_each(kv, score, False)
    prevs_kv = torch.cat([prev_kv.unsqueeze(0), kv[:-1]], dim=0)
    prevs_score = torch.cat([prev_score.unsqueeze(0), score[:-1]], dim=0)
    return pool_each(kv, score, True, prevs_kv, prevs_score)
