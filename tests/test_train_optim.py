"""Muon (hybrid Newton–Schulz, per-expert 3-D updates), the Muon/AdamW split, and the lr schedules."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import torch.optim._muon as torch_muon

from hybridkv.model import ContiguousKV, ForwardBatch, Transformer
from hybridkv.presets import load_config
from hybridkv.train.optim import (PARAM_TABLE, QUINTIC, V4_SCHEDULE, Muon, build_optimizers, describe_groups,
                                  lr_schedule, newton_schulz, param_groups)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], grads: list[list[torch.Tensor]]) -> None:
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


class _Float32NS(torch.Tensor):
    """torch.optim.Muon always runs Newton–Schulz in bfloat16 (`grad.bfloat16()`, even on CPU). Passing
    the matrix as this subclass makes that cast a float32 copy, so torch's own iteration runs in float32
    and can be compared with ours at float32 tolerance."""

    def bfloat16(self, *args, **kwargs):
        return self.float().clone()


def _torch_ns_in_float32(orig):
    def ns(grad, coefficients, steps, eps):
        return orig(grad.as_subclass(_Float32NS), coefficients, steps, eps).as_subclass(torch.Tensor)
    return ns


@pytest.mark.parametrize("float32_ns", [True, False])
def test_matches_torch_muon(monkeypatch, float32_ns):
    """torch.optim.Muon with one triple × ns_steps and adjust_lr_fn="match_rms_adamw" (update scaled by
    0.2·sqrt(max(A, B)), weight decay with the unadjusted lr) is ours with that uniform schedule and
    update_rms=0.2. With torch's NS forced to float32 the parameters agree to float32 rounding; with its
    native bfloat16 NS the parameter change agrees to ~1% (bf16 has an 8-bit mantissa)."""
    if float32_ns:
        monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz",
                            _torch_ns_in_float32(torch_muon._zeropower_via_newtonschulz))
    shapes = [(32, 64), (64, 32), (48, 48), (32, 64)]
    init = [_randn(*s, seed=i) for i, s in enumerate(shapes)]
    grads = [[_randn(*s, seed=100 * k + i) for i, s in enumerate(shapes)] for k in range(5)]
    ours = [torch.nn.Parameter(x.clone()) for x in init]
    ref = [torch.nn.Parameter(x.clone()) for x in init]
    _run(Muon(ours, lr=0.02, weight_decay=0.1, update_rms=0.2, schedule=(QUINTIC,) * 5), ours, grads)
    _run(torch.optim.Muon(ref, lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"), ref, grads)
    for p, q, x in zip(ours, ref, init):
        if float32_ns:
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=1e-6)
        else:
            moved, ref_moved = p.detach() - x, q.detach() - x
            assert (moved - ref_moved).norm() / ref_moved.norm() < 0.02


def test_expert_stack_is_updated_per_expert():
    """A [E, out, in] parameter moves exactly as E separate [out, in] parameters would."""
    stack = torch.nn.Parameter(_randn(4, 24, 40, seed=0))
    slices = [torch.nn.Parameter(s.clone()) for s in stack.detach()]
    grads = [_randn(4, 24, 40, seed=k + 1) for k in range(3)]
    _run(Muon([stack], lr=0.01), [stack], [[g] for g in grads])
    _run(Muon(slices, lr=0.01), slices, [list(g) for g in grads])
    torch.testing.assert_close(stack.detach(), torch.stack([s.detach() for s in slices]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (96, 96), (8, 32, 128)])
def test_update_rms_is_0_18(shape):
    """After the 2 polishing steps the singular values are 1 within ~5e-4, so RMS(update) = 0.18 ± 0.1%."""
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = _randn(*shape, seed=7)
    Muon([p], lr=1.0, weight_decay=0.0).step()
    assert abs(float(p.detach().pow(2).mean().sqrt()) / 0.18 - 1) < 1e-3
    sv = torch.linalg.svdvals(newton_schulz(_randn(*shape, seed=8), V4_SCHEDULE).reshape(-1, *shape[-2:]))
    assert float((sv - 1).abs().max()) < 2e-3


def test_v4_schedule():
    assert V4_SCHEDULE == ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2


def test_state_dict_resumes_exactly():
    shapes = [(16, 32), (16, 32), (3, 8, 16)]
    grads = [[_randn(*s, seed=10 * k + i) for i, s in enumerate(shapes)] for k in range(6)]
    straight = [torch.nn.Parameter(_randn(*s, seed=i)) for i, s in enumerate(shapes)]
    _run(Muon(straight, lr=0.02), straight, grads)

    first = [torch.nn.Parameter(_randn(*s, seed=i)) for i, s in enumerate(shapes)]
    opt = Muon(first, lr=0.02)
    _run(opt, first, grads[:3])
    saved = copy.deepcopy(opt.state_dict())
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = Muon(resumed, lr=0.5, momentum=0.5)  # hyper-parameters come back from the state dict
    opt2.load_state_dict(saved)
    _run(opt2, resumed, grads[3:])
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


def test_muon_rejects_vectors():
    with pytest.raises(ValueError, match="matrices"):
        Muon([torch.nn.Parameter(torch.zeros(4))], lr=0.1)


@pytest.fixture(scope="module")
def tiny_model(fixtures):
    cfg = load_config(fixtures / "v4-tiny")
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(std=0.02)
            else:
                p.fill_(1.0 if "norm" in name else 0.0)
    return model


def test_every_parameter_in_exactly_one_group(tiny_model):
    muon_groups, adamw_groups = param_groups(tiny_model, 0.02, adamw_lr=3e-3)
    names = [n for g in (*muon_groups, *adamw_groups) for n in g["names"]]
    assert sorted(names) == sorted(n for n, _ in tiny_model.named_parameters())
    assert len(set(map(id, (p for g in (*muon_groups, *adamw_groups) for p in g["params"])))) == len(names)
    muon = {n for g in muon_groups for n in g["names"]}
    for n, p in tiny_model.named_parameters():
        hidden = p.ndim >= 2 and not any(k in n for k in ("embed", "head.", "hc_", "ape"))
        assert (n in muon) == hidden, n
    for n in ("layers.1.attn.compressor.wkv.weight", "layers.1.attn.indexer.wq_b.weight",
              "layers.0.ffn.experts.3.w2.weight", "layers.0.ffn.shared_experts.w1.weight", "mtp.0.e_proj.weight"):
        assert n in muon
    assert all(g["lr"] == 0.02 for g in muon_groups)
    assert {g["rule"]: g["lr"] for g in adamw_groups}["embed"] == 3e-3
    assert all(g.get("weight_decay") == 0.0 for g in adamw_groups if g["rule"] not in ("embed", "head"))
    text = describe_groups(muon_groups, adamw_groups)
    assert len(text.splitlines()) == len(names) and "head.weight" in text


def test_frozen_and_integer_parameters_are_skipped(tiny_model):
    model = copy.deepcopy(tiny_model)
    model.embed.weight.requires_grad_(False)
    model.register_parameter("codes", torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False))
    muon_groups, adamw_groups = param_groups(model, 0.01)
    names = [n for g in (*muon_groups, *adamw_groups) for n in g["names"]]
    assert "embed.weight" not in names and "codes" not in names


def test_unmatched_parameter_raises(tiny_model):
    with pytest.raises(ValueError, match="matches no rule"):
        param_groups(tiny_model, 0.01, table=PARAM_TABLE[:-1])


def test_training_steps_lower_the_loss(tiny_model):
    model = copy.deepcopy(tiny_model)
    cfg = model.config
    opts = build_optimizers(model, 0.02, adamw_lr=3e-3)
    assert [type(o) for o in opts] == [Muon, torch.optim.AdamW]
    ids = torch.randint(2, cfg.vocab_size, (33,), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        h = model(ids[:-1], ForwardBatch.build([(ContiguousKV(cfg), 0, 32)]))
        loss = F.cross_entropy(model.logits(h).float(), ids[1:])
        for o in opts:
            o.zero_grad()
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    assert losses[2] < losses[1] < losses[0]


def test_lr_schedules():
    total, warmup, peak = 100, 10, 1.0
    wsd = [lr_schedule(s, total, warmup, peak) for s in range(total + 1)]
    assert wsd[0] == pytest.approx(0.1) and wsd[9] == pytest.approx(1.0)
    assert all(v == 1.0 for v in wsd[10:81])
    assert wsd[90] == pytest.approx(0.55) and wsd[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(wsd[10:], wsd[11:]))
    cos = [lr_schedule(s, total, warmup, peak, kind="cosine") for s in range(total + 1)]
    assert cos[10] == pytest.approx(1.0) and cos[55] == pytest.approx(0.55) and cos[100] == pytest.approx(0.1)
    assert math.isclose(lr_schedule(5, total, 0, 2.0, final_frac=0.0), 2.0)
    with pytest.raises(ValueError):
        lr_schedule(50, total, warmup, peak, kind="linear")
