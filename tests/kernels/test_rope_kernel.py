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
    """`apply_rope_`: the kernel in place (contiguous x) and the fallback (strided x, the reference
    path) give `apply_rope`'s values bit for bit, in x itself; under autograd a new tensor."""
    from hybridkv.ops.rope import apply_rope, apply_rope_
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    g = torch.Generator().manual_seed(9)
    freqs = reference.rope_freqs(torch.randint(0, 5000, (5,), generator=g), reference.yarn_inv_freq(64, 1e4)).to(device)
    for x in (torch.randn(5, 4, 512, generator=g).to(device), torch.randn(5, 4, 1024, generator=g).to(device)[..., ::2]):
        want = apply_rope(x, freqs, inverse)
        keep = x[..., :-64].clone()
        got = apply_rope_(x, freqs, inverse)
        assert got.data_ptr() == x.data_ptr() and torch.equal(got, want) and torch.equal(x[..., :-64], keep)
    leaf = torch.randn(5, 2, 128, generator=g, requires_grad=True)
    out = apply_rope_(leaf, freqs.cpu(), inverse)
    assert out is not leaf and out.requires_grad
