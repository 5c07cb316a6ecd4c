"""The indexer query's one-launch preparation (RoPE, Hadamard, FP4 round trip) against the
composition of the reference ops."""

import pytest
import torch

from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.quant import FP4_AMAX_FLOOR, fp4_round_trip, pow2_scale
from hybridkv.ops.rope import rope_freqs, yarn_inv_freq
from hybridkv.ops.rope.reference import apply_rope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,d,rd", [(3, 5, 128, 64), (2, 64, 64, 16), (1, 16, 128, 64)])
def test_rope_hadamard_fp4_matches_the_composition(device, dtype, tokens, heads, d, rd):
    from hybridkv.ops.hadamard import triton as kernels
    g = torch.Generator().manual_seed(tokens * heads + d)
    x = (torch.randn(tokens, heads, d, generator=g) * torch.logspace(-2, 1, heads)[None, :, None]).to(dtype)
    freqs = rope_freqs(torch.randint(0, 70000, (tokens,), generator=g), yarn_inv_freq(rd, 160000.0))
    want = fp4_round_trip(hadamard_transform(apply_rope(x, freqs)), 32)
    got = kernels.rope_hadamard_fp4(x.to(device), freqs.to(device)).cpu()
    assert got.dtype == dtype
    # the Hadamard sums run in another order than torch's product: a value within float32 round-off
    # of an E2M1 rounding midpoint may land one step away; everything else is equal
    differ = got != want
    assert differ.float().mean() < 2e-3, float(differ.float().mean())
    blocks = hadamard_transform(apply_rope(x, freqs)).float().unflatten(-1, (d // 32, 32))
    scale = pow2_scale(blocks.abs().amax(-1, keepdim=True).clamp(min=FP4_AMAX_FLOOR), 6.0)
    step = (2 * scale).expand(blocks.shape).flatten(-2)          # the widest E2M1 step, scaled
    assert ((got.float() - want.float()).abs() <= step).all()
