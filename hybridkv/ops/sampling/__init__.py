"""The greedy choice of a decode step's rows: each row's argmax (the first of equal maxima) and its
log-probability under the row's softmax. On the Triton path two launches over many programs
(`triton.greedy_rows`); torch's argmax and log-softmax take one block per row, tens of
microseconds for a 129K vocabulary at batch 1. Elsewhere the torch reference."""

from __future__ import annotations

import torch

from hybridkv.ops.backend import use_triton


def greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token int64 [B], its log-probability float32 [B])."""
    if use_triton(logits) and logits.shape[0] > 0 and logits.stride(-1) == 1:
        from hybridkv.ops.sampling import triton as kernels
        return kernels.greedy_rows(logits)
    return reference_greedy_rows(logits)


def reference_greedy_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = logits.float()
    tokens = torch.argmax(logits, -1)
    return tokens, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
