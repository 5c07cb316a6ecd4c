"""The batch-invariant matmul and row mean (the CUDA overrides of the deterministic mode)."""

import pytest
import torch

from helpers import rel_rms


def test_mm_and_row_mean(device):
    from hybridkv.ops import batch_invariant as bi
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(70, 40, generator=g), torch.randn(40, 33, generator=g)
    out = bi.mm(a.to(device), b.to(device)).cpu()
    assert rel_rms(a @ b, out) <= 1e-5
    # a row gives the same bits alone and inside a batch
    assert torch.equal(bi.mm(a[5:6].to(device), b.to(device)).cpu()[0], out[5])
    x = torch.randn(3, 5, 1500, generator=g)
    m = bi._mean_dim(x.to(device), [-1], True).cpu()
    assert m.shape == (3, 5, 1) and rel_rms(x.mean(-1, keepdim=True), m) <= 1e-6


@pytest.mark.parametrize("expert_fmt", ["float", "fp4"])
def test_moe_captured_and_eager_paths_agree_to_the_bit_in_deterministic_mode(device, expert_fmt):
    """Deterministic mode: the MoE a CUDA graph captures (`_routed_static`: every expert over every
    token) and the one an eager step runs (`_routed_by_expert`: each expert over its rows) give the
    same bits with the batch-invariant GEMMs, so a verify wave or a decode row beside a prefill chunk
    (eager) equals the plain decode step (captured). Ragged routing, experts nobody chose."""
    from hybridkv.model.moe import MoE
    from hybridkv.ops import batch_invariant as bi
    from hybridkv.ops.backend import deterministic
    from hybridkv.presets import get_preset
    fp4 = expert_fmt == "fp4"
    cfg = get_preset("v4-tiny-fp8" if fp4 else "v4-tiny", n_routed_experts=6, num_experts_per_tok=2)
    with torch.device(device):
        moe = MoE(cfg, 2, "fp8" if fp4 else "float", expert_fmt, torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for e in moe.experts:
            for lin in (e.w1, e.w2, e.w3):
                if fp4:
                    lin.weight.copy_(torch.randint(-128, 128, lin.weight.shape, generator=g, dtype=torch.int8))
                    lin.scale.copy_(2.0 ** torch.randint(-9, -4, lin.scale.shape, generator=g).float())
                else:
                    lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.05)
        moe.gate.weight.copy_(torch.randn(moe.gate.weight.shape, generator=g))
    x = (torch.randn(7, cfg.hidden_size, generator=g) * 3).to(device)
    own = device != "cuda"          # on CUDA the deterministic mode installs them itself
    with torch.no_grad(), deterministic():
        if own:
            bi.enable(True, "CPU")
        try:
            weights, ids = moe.gate(x, torch.zeros(7, dtype=torch.long, device=device))
            ids[0] = torch.tensor([1, 0])                    # not in expert order
            ids[1:, 0] = torch.where(ids[1:, 0] == 5, 4, ids[1:, 0])
            ids[1:, 1] = torch.where(ids[1:, 1] == 5, 4, ids[1:, 1])
            ids[:, 1] = torch.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % 5, ids[:, 1])
            captured = moe._routed_static(x, weights, ids)
            eager = moe._routed_by_expert(x, weights, ids)
        finally:
            if own:
                bi.enable(False)
    assert not (ids == 5).any() and captured.dtype == eager.dtype == torch.float32
    assert torch.equal(captured, eager)


def test_bmm_is_one_launch_of_the_same_products(device):
    """The batched product (one launch over the batch) gives each product's bits as `mm` of it alone,
    strided operands included (the MoE's per-expert w2 reads transposed views)."""
    from hybridkv.ops import batch_invariant as bi
    g = torch.Generator().manual_seed(1)
    a = torch.randn(5, 3, 70, 40, generator=g)[:, 1]                 # [5, 70, 40], batch stride > M·K
    b = torch.randn(40, 5, 33, generator=g).permute(1, 0, 2)        # [5, 40, 33], non-contiguous
    out = bi.mm(a.to(device), b.to(device)).cpu()
    assert out.shape == (5, 70, 33)
    for i in range(5):
        assert torch.equal(out[i], bi.mm(a[i].to(device), b[i].to(device)).cpu())
    assert rel_rms(torch.bmm(a, b), out) <= 1e-5
    assert bi.mm(a[:0].to(device), b[:0].to(device)).shape == (0, 70, 33)
