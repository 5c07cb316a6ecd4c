"""The RMS norm kernel against the reference: with and without a weight, rows of the model's widths
(the head dimension, the q and hidden widths, a non-power-of-two width), strided inputs, and the
input dtype kept."""

import pytest
import torch

from hybridkv.ops.rmsnorm import reference
from hybridkv.ops.rmsnorm import triton as kernels


@pytest.mark.parametrize("d", [128, 512, 1000, 4096])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_the_reference(device, d, weighted):
    g = torch.Generator().manual_seed(d + weighted)
    x = (torch.randn(3, 5, d, generator=g) * torch.logspace(-2, 2, 5)[:, None]).to(device)
    w = (torch.rand(d, generator=g) + 0.5).to(device) if weighted else None
    got = kernels.rms_norm(x, w, 1e-6)
    want = reference.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape and got.dtype == x.dtype
    # float32 sums in another order: a few ulps
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)


def test_rms_norm_reads_strided_rows_and_keeps_bf16(device):
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(7, 2 * 512, generator=g).to(device)
    x = wide[:, :512]                                   # rows 1024 apart
    got = kernels.rms_norm(x, None, 1e-6)
    torch.testing.assert_close(got, reference.rms_norm(x, None, 1e-6), rtol=2e-6, atol=1e-7)
    xb = x.bfloat16()
    w = torch.rand(512, generator=g).to(device) + 0.5
    gb = kernels.rms_norm(xb, w, 1e-6)
    assert gb.dtype == torch.bfloat16
    # one bf16 rounding of values equal to a few float32 ulps
    assert (gb.float() - reference.rms_norm(xb, w, 1e-6).float()).abs().max() <= 2 ** -7 * gb.float().abs().max()
    assert kernels.rms_norm(torch.empty(0, 512, device=device), None, 1e-6).shape == (0, 512)


def test_in_place_norm_writes_the_same_values_over_its_input(device, monkeypatch):
    """`rms_norm_`: the kernel's rows written over x (x returned), bit for bit the new tensor's;
    strided rows and autograd get a new tensor, x untouched."""
    from hybridkv.ops.rmsnorm import rms_norm_
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton" if device == "cpu" else "auto")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, 512, generator=g).to(device)
    want = kernels.rms_norm(x, None, 1e-6)
    got = rms_norm_(x, None, 1e-6)
    assert got is x and torch.equal(got, want)
    wide = torch.randn(7, 1024, generator=g).to(device)
    before = wide.clone()
    out = rms_norm_(wide[:, :512], None, 1e-6)
    assert torch.equal(wide, before) and torch.equal(out, kernels.rms_norm(wide[:, :512], None, 1e-6))
    leaf = torch.randn(3, 512, generator=g, requires_grad=True)
    assert rms_norm_(leaf, None, 1e-6) is not leaf
