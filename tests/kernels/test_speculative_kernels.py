"""The speculative step's greedy acceptance and rollback (`hybridkv.ops.speculative`): the Triton
kernels and the plain-torch path against what each should give, stated request by request (kept
counts and following tokens; states after the kept positions, ring rows of rejected positions), for
requests that keep every count from one to k + 1, rows longer than a kernel's piece, and ring rows
that wrap; the public functions' checks."""

import pytest
import torch

from hybridkv.ops.speculative import restore_ring_, restore_states_
from hybridkv.ops.speculative import triton as kernels

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


@pytest.mark.parametrize("path", ["torch", "kernel"])
def test_greedy_acceptance_keeps_drafts_while_each_is_the_argmax_before_it(device, path):
    """Requests that keep none, some and all of k = 3 drafts (a later draft equal to its argmax after
    an earlier disagreement is not kept): kept counts and the tokens that follow them."""
    from hybridkv.ops.speculative import accept_greedy
    tokens = torch.tensor([[5, 10, 11, 12], [6, 20, 21, 22], [7, 30, 31, 32], [8, 40, 41, 42]])
    argmax = torch.tensor([[10, 20, 30, 49],         # the argmax of each request's row 0 (wave 0)
                           [11, 99, 31, 41],         # row 1
                           [12, 22, 77, 42],         # row 2
                           [93, 94, 95, 96]])        # row 3: after the last draft
    fn = kernels.accept_greedy if path == "kernel" else accept_greedy
    kept, following = fn(argmax.to(device), tokens.to(device))
    assert kept.dtype == torch.long and kept.cpu().tolist() == [4, 2, 3, 1]
    assert following.cpu().tolist() == [[10, 11, 12, 93], [20, 99, 99, 99], [30, 31, 77, 77], [49, 49, 49, 49]]
