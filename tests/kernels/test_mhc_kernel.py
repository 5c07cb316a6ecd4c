"""The mHC kernels against the reference mixing and Sinkhorn."""

import torch

from helpers import rel_rms
from hybridkv.ops.mhc import reference


def test_pre_and_post(device):
    from hybridkv.ops.mhc import triton as kernels
    g = torch.Generator().manual_seed(0)
    t, hc, dim = 3, 4, 96
    x = torch.randn(t, hc, dim, generator=g)
    fn = torch.randn(24, hc * dim, generator=g) * 0.05
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
    mixes = x.flatten(1) @ fn.T
    y_ref, post_ref, comb_ref = reference.mhc_pre(x, mixes, scale, base, 20, 1e-6, 1e-6)
    dv = lambda a: a.to(device)  # noqa: E731
    y, post, comb = kernels.mhc_pre(dv(x), dv(mixes), dv(scale), dv(base), 20, 1e-6, 1e-6)
    assert rel_rms(y_ref, y.cpu()) <= 1e-3 and rel_rms(post_ref, post.cpu()) <= 1e-3
    assert rel_rms(comb_ref, comb.cpu()) <= 1e-3
    assert torch.allclose(comb.cpu().sum(-2), torch.ones(t, hc), atol=1e-4)
    f = torch.randn(t, dim, generator=g)
    out = kernels.mhc_post(dv(f), dv(x), post, comb).cpu()
    assert rel_rms(reference.mhc_post(f, x, post_ref, comb_ref), out) <= 1e-3
