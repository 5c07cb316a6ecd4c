"""QAT fake quantisation: forward bit-identical to the inference numerics, identity gradient, exact export."""

import pytest
import torch
import torch.nn.functional as F

from hybridkv.model.linear import Linear
from hybridkv.ops.quant import act_quant_sim, dequant_fp4_weight, fp4_round_trip, fp8_round_trip
from hybridkv.train.qat import (fp4_round_trip_ste, fp4_weight_fake, fp8_act_fake, fp8_round_trip_ste,
                                quantize_fp4_weight_for_export)

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (tells -0 from +0)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(_INT_VIEW[a.dtype]),
                                                                     b.view(_INT_VIEW[b.dtype]))


def _awkward(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Random values over many magnitudes, plus exact E2M1 ties, zero blocks, tiny negatives (-> -0)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-12, 8, shape, generator=gen).float())
    flat = x.view(-1, 32)
    flat[0] = torch.tensor([6.0, 0.25, -0.75, 1.25, 2.5, -3.5, 5.0, 0.0] * 4)  # amax 6 -> scale 1: ties
    flat[1] = 0.0
    flat[2, :16] = -1e-6
    flat[2, 16] = 1.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (4, 32, 64)])
def test_fp4_weight_fake_is_the_exported_weight(shape, dtype):
    w = _awkward(shape, dtype)
    packed, scale = quantize_fp4_weight_for_export(w)
    assert packed.dtype == torch.int8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (*shape[:-1], shape[-1] // 32)
    fake = fp4_weight_fake(w)
    assert _same_bits(fake, dequant_fp4_weight(packed, scale, 32, dtype))
    assert torch.equal(fake, fp4_round_trip(w, 32))  # the same values up to the sign of zero


def test_fp4_linear_forward_matches_inference_layer():
    """A float layer trained with QAT computes what the exported "fp4" Linear computes."""
    w = _awkward((64, 128))
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    layer = Linear(128, 64, "fp4", torch.float32)
    packed, scale = quantize_fp4_weight_for_export(w)
    layer.weight.data.copy_(packed)
    layer.scale.data.copy_(scale)
    qat = F.linear(fp8_act_fake(x, layer.act_block), fp4_weight_fake(w))
    assert _same_bits(qat, layer(x))


@pytest.mark.parametrize("pow2", [True, False])
def test_fp8_fakes_match_ops(pow2):
    x = _awkward((6, 256), seed=2)
    assert _same_bits(fp8_act_fake(x, 128), act_quant_sim(x, 128))
    assert _same_bits(fp8_round_trip_ste(x, 64, pow2), fp8_round_trip(x, 64, pow2))
    xb = x.bfloat16()
    assert _same_bits(fp8_round_trip_ste(xb, 128, pow2), fp8_round_trip(xb, 128, pow2))


@pytest.mark.parametrize("scale_fmt,block", [("ue8m0", 32), ("e4m3", 16)])
def test_fp4_round_trip_ste_matches_ops(scale_fmt, block):
    x = _awkward((6, 256), seed=3)
    assert _same_bits(fp4_round_trip_ste(x, block, scale_fmt), fp4_round_trip(x, block, scale_fmt))


@pytest.mark.parametrize("fake", [
    fp4_weight_fake,
    lambda t: fp8_act_fake(t, 128),
    lambda t: fp8_round_trip_ste(t, 64, False),
    lambda t: fp4_round_trip_ste(t, 32),
    lambda t: fp4_round_trip_ste(t, 16, "e4m3"),
])
def test_gradient_is_identity(fake):
    x = _awkward((8, 256), seed=4).requires_grad_(True)
    g = torch.randn(8, 256, generator=torch.Generator().manual_seed(5))
    (grad,) = torch.autograd.grad(fake(x), x, g)
    assert _same_bits(grad, g)


def test_gradient_reaches_master_weight_through_a_layer():
    w = _awkward((64, 128)).requires_grad_(True)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(6))
    F.linear(x, fp4_weight_fake(w)).square().sum().backward()
    expected = (2 * F.linear(x, fp4_weight_fake(w.detach()))).T @ x  # d/dW of sum((x Wqᵀ)²) with dWq/dW = I
    torch.testing.assert_close(w.grad, expected)
