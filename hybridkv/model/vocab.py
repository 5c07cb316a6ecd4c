"""The embedding split by vocabulary over the ranks of a sharded model (distributed/sharding.py):
each rank holds a contiguous range of rows; a token's row comes from the one rank that holds it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.group import Parallel
from hybridkv.distributed.sharding import record, vocab_part


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, parallel: Parallel):
        super().__init__()
        self.parallel = parallel
        self.start, stop, _ = vocab_part(vocab, parallel)
        self.weight = nn.Parameter(torch.empty(stop - self.start, dim, dtype=dtype))
        record(self, "weight", (0, self.start, stop))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), self.weight)
        # one rank holds each row and the others add zeros: the sum is that row exactly
        return self.parallel.all_reduce(rows.masked_fill(~mine.unsqueeze(-1), 0))
