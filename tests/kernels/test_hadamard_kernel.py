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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,rd,block,fmt", [((3, 5, 128), 64, 32, "ue8m0"), ((4, 512), 64, 16, "e4m3"),
                                                ((2, 1, 128), 64, 32, "ue8m0"), ((5, 3, 64), 16, 16, "e4m3")])
def test_rope_fp4_matches_the_composition(device, monkeypatch, dtype, shape, rd, block, fmt):
    """V4.1's indexer queries and keys (blocks of 32, power-of-two scales) and global KV (blocks of
    16, e4m3 scales) in one launch: the rotation, then the FP4 round trip, as the two ops compute
    them. `rope_fp4` takes the kernel (2-D rows too) where Triton runs."""
    from hybridkv.ops.hadamard import rope_fp4
    g = torch.Generator().manual_seed(sum(shape) + block)
    x = (torch.randn(*shape, generator=g) * torch.logspace(-2, 1, shape[-1])).to(dtype)
    freqs = rope_freqs(torch.randint(0, 70000, (shape[0],), generator=g), yarn_inv_freq(rd, 160000.0))
    rotated = apply_rope(x, freqs)
    want = fp4_round_trip(rotated, block, fmt)           # the CPU's reference ops
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    got = rope_fp4(x.to(device), freqs.to(device), block, fmt).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    # the rotation's products may round differently in the last bit (fused or not): a value that
    # lands exactly on an E2M1 rounding midpoint may then move one step; everything else is equal
    differ = got != want
    assert differ.float().mean() < 2e-3, float(differ.float().mean())
    amax = rotated.float().unflatten(-1, (-1, block)).abs().amax(-1, keepdim=True)
    step = (amax * 0.36).expand(*amax.shape[:-1], block).flatten(-2)     # the widest E2M1 step, scaled
    assert ((got.float() - want.float()).abs() <= step).all()
    assert not torch.equal(got, x)
