"""Training batches: task examples (`hybridkv.tasks`) of the stage's length, deterministic in
(seed, step, row) so that a resumed run sees the same stream; built one step ahead on a thread."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from hybridkv.tasks.generators import Pools, training_example


class TaskBatches:
    def __init__(self, tok, seed: int, task_weights: dict[str, float] | None = None):
        self.pools = Pools(tok, seed=seed)
        self.seed, self.weights = seed, task_weights
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._ahead: tuple[tuple[int, int, int], Future] | None = None

    def _build(self, step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = np.empty((batch, seq_len), dtype=np.int64)
        sup = np.empty((batch, seq_len), dtype=bool)
        for r in range(batch):
            ids[r], sup[r] = training_example((self.seed * 1_000_003 + step) * 64 + r, self.pools, seq_len,
                                              self.weights)
        return torch.from_numpy(ids), torch.from_numpy(sup)

    def get(self, step: int, batch: int, seq_len: int, next_shape: tuple[int, int] | None = None):
        """The batch of `step`; starts building step + 1 (of `next_shape`) in the background."""
        key = (step, batch, seq_len)
        if self._ahead is not None and self._ahead[0] == key:
            out = self._ahead[1].result()
        else:
            out = self._build(step, batch, seq_len)
        if next_shape is not None:
            self._ahead = ((step + 1, *next_shape), self._pool.submit(self._build, step + 1, *next_shape))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
