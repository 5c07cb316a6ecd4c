"""The speculative step's rollback (`hybridkv.ops.rollback`): the Triton kernels and the plain-torch
path against a loop over requests that states what each restores (states after the kept positions,
ring rows of rejected positions), for requests that keep every count from one to k + 1, rows longer
than a kernel's piece, and ring rows that wrap; the public functions' checks."""

import pytest
import torch

from hybridkv.ops.rollback import restore_ring_, restore_states_
from hybridkv.ops.rollback import triton as kernels

K, N, SLOTS = 3, 2, 6


def _states(row_shape, gen):
    kv = torch.randn(N, SLOTS, *row_shape, generator=gen)
    score = torch.randn(N, SLOTS, *row_shape, generator=gen)
    slots, kept = torch.tensor([4, 1, 2, 5]), torch.tensor([1, 4, 3, 2])     # kept: 1..k+1
    copies = [torch.randn(K, N, 4, *row_shape, generator=gen) for _ in range(2)]
    want = [kv.clone(), score.clone()]
    for b, (slot, m) in enumerate(zip(slots.tolist(), kept.tolist())):
        if m <= K:      # back to the state after m kept positions; all k + 1 kept: as it is
            for w, c in zip(want, copies):
                w[:, slot] = c[m - 1, :, b]
    return kv, score, copies, slots, kept, want


@pytest.mark.parametrize("row_shape", [(2, 3), (3, 500)])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_states_go_back_to_the_copy_after_the_kept_positions(device, row_shape, path):
    kv, score, (kv_c, score_c), slots, kept, want = _states(row_shape, torch.Generator().manual_seed(0))
    args = [t.to(device) for t in (kv, score, kv_c, score_c, slots, kept)]
    (kernels.restore_states if path == "kernel" else restore_states_)(*args)
    assert torch.equal(args[0].cpu(), want[0]) and torch.equal(args[1].cpu(), want[1])


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 64), (torch.uint8, 1100)])
@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_rejected_positions_ring_rows_are_put_back(device, dtype, width, path):
    gen = torch.Generator().manual_seed(1)
    layers, W, k1 = 3, 8, K + 1
    rings = torch.randint(0, 200, (layers, SLOTS, W, width), generator=gen).to(dtype)
    saved = torch.randint(0, 200, (layers, 3, k1, width), generator=gen).to(dtype)
    slots, first, kept = torch.tensor([2, 0, 5]), torch.tensor([6, 13, 0]), torch.tensor([2, 4, 1])
    want = rings.clone()
    for b, (slot, p, m) in enumerate(zip(slots.tolist(), first.tolist(), kept.tolist())):
        for j in range(m, k1):          # rejected: the row before the verify forward wrote it
            want[:, slot, (p + j) % W] = saved[:, b, j]
    args = [t.to(device) for t in (rings, saved, slots, first, kept)]
    (kernels.restore_ring if path == "kernel" else restore_ring_)(*args)
    assert torch.equal(args[0].cpu(), want)


def test_rollback_checks_its_arguments():
    kv = torch.zeros(N, SLOTS, 2, 3)
    with pytest.raises(ValueError, match="do not match"):
        restore_states_(kv, kv.clone(), torch.zeros(K, N + 1, 4, 2, 3), torch.zeros(K, N + 1, 4, 2, 3),
                        torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long))
    with pytest.raises(ValueError, match="contiguous"):
        restore_states_(kv.transpose(2, 3).contiguous().transpose(2, 3), kv.clone(), torch.zeros(K, N, 4, 2, 3),
                        torch.zeros(K, N, 4, 2, 3), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.long))
    rings = torch.zeros(2, SLOTS, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not match the rings"):
        restore_ring_(rings, torch.zeros(2, 3, 2, 16), torch.zeros(3, dtype=torch.long),
                      torch.zeros(3, dtype=torch.long), torch.ones(3, dtype=torch.long))
