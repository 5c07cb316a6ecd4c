"""The rotary-embedding kernel against the reference: per-head queries, single rows, the inverse
rotation, one rotation row for all tokens, strided inputs and bf16 (rounded once, as the
reference rounds)."""

import pytest
import torch

from hybridkv.ops.rope import reference
from hybridkv.ops.rope import triton as kernels


@pytest.mark.parametrize("shape,rd", [((5, 4, 512), 64), ((7, 512), 64), ((3, 2, 128), 64), ((4, 64), 64)])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_the_reference(device, shape, rd, inverse):
    g = torch.Generator().manual_seed(sum(shape) + rd)
    x = torch.randn(*shape, generator=g).to(device)
    freqs = reference.rope_freqs(torch.randint(0, 100000, (shape[0],), generator=g), reference.yarn_inv_freq(rd, 1e4))
    freqs = freqs.to(device)
    got = kernels.apply_rope(x, freqs, inverse)
    want = reference.apply_rope(x, freqs, inverse)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[..., :-rd], x[..., :-rd])


def test_rope_one_rotation_row_strided_input_and_bf16(device):
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 3, 2 * 256, generator=g).to(device)
    x = wide[..., :256]
    freqs = reference.rope_freqs(torch.tensor([77]), reference.yarn_inv_freq(64, 1e4)).to(device)
    torch.testing.assert_close(kernels.apply_rope(x, freqs), reference.apply_rope(x, freqs), rtol=1e-6, atol=1e-6)
    xb = torch.randn(6, 3, 256, generator=g).bfloat16().to(device)
    f6 = reference.rope_freqs(torch.arange(6) * 1000, reference.yarn_inv_freq(64, 1e4)).to(device)
    got, want = kernels.apply_rope(xb, f6), reference.apply_rope(xb, f6)
    assert got.dtype == torch.bfloat16
    # one bf16 step at most: the interpreter casts by truncation, and a GPU may fuse the products
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.parametrize("inverse", [False, True])
def test_rope_in_place_rotates_only_the_last_dims_where_they_lie(device, inverse, monkeypatch):
    """`apply_rope_`: the kernel in place (contiguous x) gives the kernel's values and the fallback
    (strided x) the reference's, bit for bit, in x itself; under autograd a new tensor. (On the GPU
    the kernel and the reference may differ in the last bit: the compiler fuses the products.)"""
    from hybridkv.ops.rope import apply_rope, apply_rope_
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    g = torch.Generator().manual_seed(9)
    freqs = reference.rope_freqs(torch.randint(0, 5000, (5,), generator=g), reference.yarn_inv_freq(64, 1e4)).to(device)
    for x in (torch.randn(5, 4, 512, generator=g).to(device), torch.randn(5, 4, 1024, generator=g).to(device)[..., ::2]):
        want = apply_rope(x, freqs, inverse) if x.is_contiguous() else reference.apply_rope(x, freqs, inverse)
        keep = x[..., :-64].clone()
        got = apply_rope_(x, freqs, inverse)
        assert got.data_ptr() == x.data_ptr() and torch.equal(got, want) and torch.equal(x[..., :-64], keep)
    leaf = torch.randn(5, 2, 128, generator=g, requires_grad=True)
    out = apply_rope_(leaf, freqs.cpu(), inverse)
    assert out is not leaf and out.requires_grad


@pytest.mark.parametrize("offset,clamp_min", [(0, None), (1 - 128, 0), (-3, None)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_rotations_in_one_launch(device, offset, clamp_min, dtype):
    """`rope_freqs` (complex, and split into cosines and sines): the reference's rotations at
    max(position + offset, clamp_min) — on the GPU to the bit (the CUDA math library's cos and sin,
    as torch's), in the interpreter within numpy's rounding of them."""
    g = torch.Generator().manual_seed(7)
    pos = torch.cat([torch.tensor([0, 1, 127, 128]), torch.randint(0, 1 << 20, (37,), generator=g)]).to(dtype)
    inv = reference.yarn_inv_freq(64, 160000.0, 16, 65536, 32, 1)
    p = (pos.long() + offset)
    want = reference.rope_freqs(p.clamp(min=clamp_min) if clamp_min is not None else p, inv)
    got = kernels.rope_freqs(pos.to(device), inv.to(device), offset, clamp_min).cpu()
    cos, sin = kernels.rope_freqs(pos.to(device), inv.to(device), offset, clamp_min, split=True)
    assert got.dtype == torch.complex64 and got.shape == want.shape
    assert cos.is_contiguous() and sin.is_contiguous() and cos.shape == want.shape
    if device == "cuda":        # against torch's own rotations on the GPU
        p = p.clamp(min=clamp_min) if clamp_min is not None else p
        assert torch.equal(got, reference.rope_freqs(p.to(device), inv.to(device)).cpu())
    else:
        torch.testing.assert_close(torch.view_as_real(got), torch.view_as_real(want), rtol=0, atol=2e-7)
    assert torch.equal(cos.cpu(), got.real) and torch.equal(sin.cpu(), got.imag)
