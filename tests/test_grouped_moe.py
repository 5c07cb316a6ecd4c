"""The grouped MoE's routing logic on the CPU: tokens sorted by expert with torch operations only,
and the grouped computation over the sorted tokens equal to the per-expert loop bit for bit."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybridkv.model.moe import MoE
from hybridkv.ops.grouped_moe import reference
from hybridkv.presets import get_preset
from hybridkv.train.init import init_weights


def _moe(layer_id: int, fp8: bool, seed: int = 0, **over) -> MoE:
    cfg = get_preset("v4-tiny-fp8" if fp8 else "v4-tiny", **over)
    moe = MoE(cfg, layer_id, "fp8" if fp8 else "float", "fp4" if fp8 else "float", torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for e in list(moe.experts) + [moe.shared_experts]:
            for lin in (e.w1, e.w2, e.w3):
                if lin.fmt == "float":
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
                elif lin.fmt == "fp8":
                    lin.weight.copy_((torch.randn(lin.weight.shape, generator=g) * 20).to(torch.float8_e4m3fn))
                    lin.scale.copy_(torch.full(lin.scale.shape, 2.0 ** -9).to(torch.float8_e8m0fnu))
                else:
                    lin.weight.copy_(torch.randint(-128, 128, lin.weight.shape, generator=g, dtype=torch.int8))
                    lin.scale.copy_(torch.full(lin.scale.shape, 2.0 ** -6).to(torch.float8_e8m0fnu))
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g) * 0.1)
        if moe.gate.hash:
            moe.gate.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=g)
                                   .argsort(-1)[:, :moe.gate.topk].int())
        else:
            moe.gate.bias.copy_(torch.randn(cfg.n_routed_experts, generator=g) * 0.1)
    return moe


def test_sort_by_expert_orders_pairs_stably_and_inverts():
    ids = torch.tensor([[3, 0], [0, 5], [5, 3], [1, 0]])
    s = reference.sort_by_expert(ids, 8)
    assert s.counts.tolist() == [3, 1, 0, 2, 0, 2, 0, 0]
    assert s.offsets.tolist() == [0, 3, 4, 4, 6, 6, 8, 8, 8]
    assert s.expert.tolist() == [0, 0, 0, 1, 3, 3, 5, 5]
    assert s.token.tolist() == [0, 1, 3, 3, 0, 2, 1, 2]            # token order kept within an expert
    assert torch.equal(ids.flatten()[s.order], s.expert)
    assert torch.equal(s.order[s.inverse], torch.arange(8))


@pytest.mark.parametrize("block_m", [1, 2, 4])
def test_expert_tiles_cover_each_expert_row_once(block_m):
    g = torch.Generator().manual_seed(block_m)
    ids = torch.rand(9, 16, generator=g).argsort(-1)[:, :3]
    s = reference.sort_by_expert(ids, 16)
    expert, start, end = reference.expert_tiles(s, block_m)
    assert expert.shape[0] == -(-27 // block_m) + 16
    covered = torch.zeros(27, dtype=torch.int64)
    for e, a, b in zip(expert.tolist(), start.tolist(), end.tolist()):
        if e < 0:
            continue
        rows = torch.arange(a, min(a + block_m, b))
        assert len(rows) > 0 and bool((s.expert[rows] == e).all())
        covered[rows] += 1
    assert covered.tolist() == [1] * 27


class _Recorder(TorchDispatchMode):
    HOST = {torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.bincount,
            torch.ops.aten.lift_fresh, torch.ops.aten.masked_select}

    def __init__(self):
        super().__init__()
        self.flagged = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in self.HOST:
            self.flagged.add(str(func))
        return func(*args, **(kwargs or {}))


def test_sorting_tiling_and_combining_never_read_values_back():
    ids = torch.tensor([[3, 0], [0, 5], [5, 3]])
    out = torch.randn(6, 4)
    with _Recorder() as rec:
        s = reference.sort_by_expert(ids, 8)
        reference.expert_tiles(s, 16)
        reference.combine(out, s, ids)
    assert not rec.flagged, rec.flagged


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8-fp4"])
@pytest.mark.parametrize("layer_id", [0, 2], ids=["hash", "learned"])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_grouped_computation_equals_the_per_expert_loop(fp8, layer_id, tokens):
    """Bit for bit, including experts that no token chose (most of them at 1 token) and hash
    routing (layer 0 of v4-tiny)."""
    moe = _moe(layer_id, fp8, seed=tokens)
    assert moe.gate.hash == (layer_id == 0)
    g = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=g)
    input_ids = torch.randint(0, moe.gate.tid2eid.shape[0] if moe.gate.hash else 500, (tokens,), generator=g)
    with torch.no_grad():
        want = moe(x, input_ids)
        weights, ids = moe.gate(x, input_ids)
        routed = reference.routed_experts(x, weights, ids, moe.n_experts,
                                          lambda e, rows, route: moe.experts[e](rows, route))
        got = (routed + moe.shared_experts(x).float()).to(x.dtype)
    if tokens == 1:
        assert (reference.sort_by_expert(ids, moe.n_experts).counts == 0).sum() == moe.n_experts - ids.shape[1]
    assert torch.equal(got, want)


def _per_expert_loop(moe: MoE, x, weights, ids) -> torch.Tensor:
    """Each of the layer's experts over its rows, one after another (the definition)."""
    y = torch.zeros_like(x, dtype=torch.float32)
    for e in range(moe.expert_offset, moe.expert_offset + len(moe.experts)):
        rows, slot = torch.where(ids == e)
        if rows.numel():
            y[rows] += moe.experts[e - moe.expert_offset](x[rows], weights[rows, slot, None]).float()
    return y


@pytest.mark.parametrize("fp8", [False, True], ids=["float", "fp8-fp4"])
@pytest.mark.parametrize("tokens", [1, 2, 37])
def test_experts_of_one_rank_equal_the_per_expert_loop(fp8, tokens):
    """Expert parallelism: a rank holding experts [4, 8) adds only their outputs (the other pairs
    add zero), bit for bit as the loop over its experts."""
    moe = _moe(2, fp8, seed=tokens)
    moe.experts, moe.expert_offset = moe.experts[4:], 4
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, moe.gate.weight.shape[1], generator=g)
    with torch.no_grad():
        weights, ids = moe.gate(x, torch.zeros(tokens, dtype=torch.long))
        assert torch.equal(moe._routed_by_expert(x, weights, ids), _per_expert_loop(moe, x, weights, ids))
        # a rank none of whose experts was chosen adds zero
        elsewhere = ids % 4
        assert torch.equal(moe._routed_by_expert(x, weights, elsewhere), torch.zeros_like(x))


def test_routed_experts_give_the_per_expert_loop_gradients():
    """Training runs the same path: its gradients (input, routing weights, expert weights) equal
    the loop's."""
    moe = _moe(2, False, seed=5)
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(11, moe.gate.weight.shape[1], generator=g)
    grads = []
    for fn in (moe._routed_by_expert, lambda *a: _per_expert_loop(moe, *a)):
        moe.zero_grad()
        x = x0.clone().requires_grad_()
        weights, ids = moe.gate(x, torch.zeros(11, dtype=torch.long))
        fn(x, weights, ids).square().sum().backward()
        grads.append([x.grad, moe.gate.weight.grad] + [p.grad for e in moe.experts for p in e.parameters()])
    for a, b in zip(*grads):
        assert (a is None and b is None) or torch.allclose(a, b, rtol=1e-6, atol=1e-7)
