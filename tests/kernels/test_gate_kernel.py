"""The gate selection (V4's, and V4.1's with its temperature) in one launch against `Gate.forward`'s torch operations (the scores from
one GEMM in both), and the scores' split-K launch at decode sizes against the float32 GEMM."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model import moe
from hybridkv.model.moe import Gate
from hybridkv.presets import get_preset


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("preset,hash_layer", [("v4-flash", False), ("v4-flash", True), ("v4.1-flash", False)])
def test_gate_select_matches_the_gate(device, monkeypatch, tokens, preset, hash_layer):
    cfg = get_preset(preset)
    experts = cfg.n_routed_experts
    if preset == "v4.1-flash":
        cfg = dataclasses.replace(cfg, gate_temp=1.7)      # V4.1's logits divided by a temperature
    gate = Gate(cfg, 0 if hash_layer else cfg.num_hash_layers)
    assert gate.hash == hash_layer and gate.topk == 6 and gate.weight.shape[0] == experts
    g = torch.Generator().manual_seed(tokens + 100 * hash_layer)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g) * 0.02)
        if hash_layer:
            gate.tid2eid.copy_(torch.rand(cfg.vocab_size, experts, generator=g).argsort(-1)[:, :6].int())
        else:
            gate.bias.copy_(torch.randn(experts, generator=g) * 0.1)
    gate = gate.to(device)
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    x[0] *= 300                                    # logits past softplus' threshold (20) and far below 0
    x, ids_in = x.to(device), torch.randint(0, cfg.vocab_size, (tokens,), generator=g).to(device)
    with torch.no_grad():
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
        scores = moe.widened_linear(x, gate.weight, torch.float32)
        ref = F.linear(x.float(), gate.weight.float())
        assert ((scores - ref).norm(dim=-1) / ref.norm(dim=-1)).max() < 1e-6    # float32 round-off
        # the selection compared on the same scores (the split-K launch sums in another order)
        monkeypatch.setattr(moe, "widened_linear", lambda a, w, dtype: F.linear(a.float(), w.float()))
        monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
        want_w, want_ids = gate(x, ids_in)
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
        got_w, got_ids = gate(x, ids_in)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    # (a hash layer may route to an expert whose score is a float32 subnormal, where exp()
    # implementations differ: hence the absolute term, 1e-20 of weights that sum to 1.5)
    torch.testing.assert_close(got_w, want_w, rtol=2e-6, atol=1e-20)
