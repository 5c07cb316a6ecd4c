"""The batch-invariant matmul and row mean (the CUDA overrides of the deterministic mode)."""

import torch

from helpers import rel_rms


def test_mm_and_row_mean(device):
    from hybridkv.ops import batch_invariant as bi
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(70, 40, generator=g), torch.randn(40, 33, generator=g)
    out = bi.mm(a.to(device), b.to(device)).cpu()
    assert rel_rms(a @ b, out) <= 1e-5
    # a row gives the same bits alone and inside a batch
    assert torch.equal(bi.mm(a[5:6].to(device), b.to(device)).cpu()[0], out[5])
    x = torch.randn(3, 5, 1500, generator=g)
    m = bi._mean_dim(x.to(device), [-1], True).cpu()
    assert m.shape == (3, 5, 1) and rel_rms(x.mean(-1, keepdim=True), m) <= 1e-6
