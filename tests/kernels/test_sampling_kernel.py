"""The greedy rows kernel against torch's argmax and log-softmax."""

import torch

from hybridkv.ops.sampling import reference_greedy_rows


def test_greedy_rows_match_torch(device):
    """Random rows (a vocabulary no chunk divides), a maximum in the last chunk, and ties across
    chunks and within one (the first index wins, as torch's argmax)."""
    from hybridkv.ops.sampling import triton as kernels
    g = torch.Generator().manual_seed(0)
    v = 3 * kernels.CHUNK + 77
    x = torch.randn(5, v, generator=g) * 3
    x[1, v - 1] = 50.0                               # in the ragged last chunk
    x[2, 10] = x[2, kernels.CHUNK + 5] = 40.0        # equal maxima in two chunks
    x[3, 7] = x[3, 9] = 40.0                         # equal maxima in one chunk
    want_tok, want_lp = reference_greedy_rows(x)
    tok, lp = kernels.greedy_rows(x.to(device))
    assert torch.equal(tok.cpu(), want_tok)
    assert tok.cpu().tolist()[1:4] == [v - 1, 10, 7]
    assert torch.allclose(lp.cpu(), want_lp, rtol=1e-5, atol=1e-6)
