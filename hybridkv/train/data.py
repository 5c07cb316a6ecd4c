"""Training batches: task examples (`hybridkv.tasks`) of the stage's length, deterministic in
(seed, step, row) so that a resumed run sees the same stream; built one step ahead on a thread."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hybridkv.tasks.generators import Pools, training_example


class TaskBatches:
    def __init__(self, tok, seed: int, pool_seed: int | None = None, next_document: int = 0):
        """`seed` draws the examples; `pool_seed` (default `seed`) the haystack material;
        `next_document`: see `training_example`. Real-text tasks read the training part of the
        prose only (`hybridkv.tasks.prose`)."""
        self.pools = Pools(tok, seed=seed if pool_seed is None else pool_seed, prose_split="train")
        self.seed, self.next_document = seed, next_document
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._ahead: tuple[tuple, Future] | None = None

    def _build(self, step: int, batch: int, seq_len: int, mix) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.empty((batch, seq_len), dtype=np.int64)
        sup = np.empty((batch, seq_len), dtype=bool)
        for r in range(batch):
            ids[r], sup[r] = training_example((self.seed * 1_000_003 + step) * 64 + r, self.pools, seq_len, mix,
                                              self.next_document)
        return torch.from_numpy(ids), torch.from_numpy(sup)

    def get(self, step: int, batch: int, seq_len: int, mix: dict[str, float] | None = None,
            following: tuple | None = None):
        """The batch of `step` (task mix `mix`, None = uniform); starts building step + 1 with
        `following` = (batch, seq_len, mix) in the background."""
        key = (step, batch, seq_len, repr(mix))
        if self._ahead is not None and self._ahead[0] == key:
            out = self._ahead[1].result()
        else:
            out = self._build(step, batch, seq_len, mix)
        if following is not None:
            self._ahead = ((step + 1, following[0], following[1], repr(following[2])),
                           self._pool.submit(self._build, step + 1, *following))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
