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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rope_in_one_launch_give_the_two_launches_bits(device, dtype):
    """`rms_norm_rope`: the norm kernel and then the rope kernel, bit for bit, for a V4 decode step's
    query heads (no weight, written over q) and its KV row (weighted, rows read from a wider
    projection output), with per-token rotations and with one rotation for every token."""
    from hybridkv.ops.rope import reference as rope_reference
    from hybridkv.ops.rope import triton as rope_kernels
    g = torch.Generator().manual_seed(3)
    t, heads, d, rd = 3, 4, 512, 64
    freqs = rope_reference.rope_freqs(torch.arange(100, 100 + t), 1.0 / 10000 ** (torch.arange(0, rd, 2) / rd)).to(device)
    q = (torch.randn(t, heads, d, generator=g) * 3).to(device, dtype)
    want = rope_kernels.apply_rope(kernels.rms_norm(q, None, 1e-6), freqs)
    got = kernels.rms_norm_rope(q.clone(), None, 1e-6, freqs)
    assert got.dtype == dtype and torch.equal(got, want)
    q_in = q.clone()
    assert kernels.rms_norm_rope(q_in, None, 1e-6, freqs, in_place=True) is q_in and torch.equal(q_in, want)
    wide = (torch.randn(t, d + 1024, generator=g) * 0.1).to(device, dtype)
    kv_a, w = wide[:, 1024:], (torch.rand(d, generator=g) + 0.5).to(device)
    for f in (freqs, freqs[:1]):
        want = rope_kernels.apply_rope(kernels.rms_norm(kv_a, w, 1e-6), f)
        assert torch.equal(kernels.rms_norm_rope(kv_a, w, 1e-6, f), want)
    # and both against the reference's arithmetic
    ref = rope_reference.apply_rope(reference.rms_norm(kv_a, w, 1e-6), freqs)
    tol = dict(rtol=2e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(kernels.rms_norm_rope(kv_a, w, 1e-6, freqs), ref, **tol)
    with pytest.raises(ValueError, match="rotations"):
        kernels.rms_norm_rope(kv_a, w, 1e-6, freqs[:2])


def test_norm_and_rope_off_the_kernels_is_the_reference_pair(monkeypatch):
    """Off the Triton path (the CPU engine, autograd) `rms_norm_rope` is the reference norm and rope."""
    from hybridkv.ops.rmsnorm import rms_norm_rope
    from hybridkv.ops.rope import reference as rope_reference
    monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 128, generator=g)
    freqs = rope_reference.rope_freqs(torch.arange(2), 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32))
    w = torch.rand(128, generator=g, requires_grad=True)
    got = rms_norm_rope(x, w, 1e-6, freqs)
    assert torch.equal(got, rope_reference.apply_rope(reference.rms_norm(x, w, 1e-6), freqs))
    assert got.requires_grad


def test_norm_and_rope_asked_in_place_on_strided_rows_stays_in_the_kernel(device, monkeypatch):
    """`rms_norm_rope(..., in_place=True)` on strided rows: the kernel's values in a new tensor, x
    untouched (not the reference pair)."""
    from hybridkv.ops.rmsnorm import rms_norm_rope
    from hybridkv.ops.rope import reference as rope_reference
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton" if device == "cpu" else "auto")
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(3, 1024, generator=g).to(device)
    x, before = wide[:, :512], wide.clone()
    freqs = rope_reference.rope_freqs(torch.arange(3), 1.0 / 10000 ** (torch.arange(0, 64, 2) / 64)).to(device)
    got = rms_norm_rope(x, None, 1e-6, freqs, in_place=True)
    assert got.data_ptr() != x.data_ptr() and torch.equal(wide, before)
    assert torch.equal(got, kernels.rms_norm_rope(x, None, 1e-6, freqs))
