"""Weights the release ships in FP8 and its conversion widens to bf16 (`wo_a`): stored back as FP8
without losing a bit, and the grouped few-row GEMM that reads them, against the dense einsum."""

import pytest
import torch

from helpers import rel_rms
from hybridkv.model.linear import Linear, grouped_output
from hybridkv.ops.qgemm import fp8_exact
from hybridkv.ops.quant import dequant_fp8_weight, quant_fp8_weight


def _widened(n, k, g, scale_up: int = 0) -> torch.Tensor:
    """A bf16 weight holding FP8 values: blocks of very different magnitudes, optionally scaled by a
    power of two larger than the blocks need (a release's scales need not be the amax rule's)."""
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 0, n // 128).repeat_interleave(128)[:, None]
    q, s = quant_fp8_weight(w)
    if scale_up:
        q = (q.float() / 2 ** scale_up).to(torch.float8_e4m3fn)       # exact: small values become subnormal
        s = (s.float() * 2 ** scale_up).to(torch.float8_e8m0fnu)
    return dequant_fp8_weight(q, s, (128, 128), torch.bfloat16)


@pytest.mark.parametrize("scale_up", [0, 3])
def test_a_widened_fp8_weight_packs_back_exactly(scale_up):
    w = _widened(256, 384, torch.Generator().manual_seed(scale_up), scale_up)
    w[128:, 256:] = 0                                              # an all-zero block
    packed = fp8_exact.exact_fp8(w)
    assert packed is not None
    q, s = packed
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 384) and s.shape == (2, 3)
    assert torch.equal(dequant_fp8_weight(q, s, (128, 128), torch.bfloat16), w)


def test_weights_that_are_not_fp8_stay_as_they_are():
    g = torch.Generator().manual_seed(0)
    plain = (torch.randn(256, 256, generator=g) * 0.02).to(torch.bfloat16)
    assert fp8_exact.exact_fp8(plain) is None
    one_off = _widened(256, 256, g)
    one_off[7, 9] = one_off[7, 9] * (1 + 2 ** -6)                 # one value off the e4m3 grid
    assert fp8_exact.exact_fp8(one_off) is None
    assert fp8_exact.exact_fp8(_widened(256, 256, g)[:, :200]) is None     # not whole blocks
    lin = Linear(256, 256, "float", torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(plain)
    assert not lin.compact_exact_fp8() and lin.fmt == "float" and torch.equal(lin.weight, plain)


def test_a_compacted_linear_gives_the_float_linears_numbers():
    """`Linear.compact_exact_fp8`: half the bytes; its dense weight, forward and grouped output (the
    einsum where no kernel runs) equal the float linear's bit for bit."""
    g = torch.Generator().manual_seed(1)
    w = _widened(512, 256, g)
    lin, ref = Linear(256, 512, "float", torch.bfloat16), Linear(256, 512, "float", torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
        ref.weight.copy_(w)
    assert lin.compact_exact_fp8()
    assert lin.fmt == "fp8_exact" and lin.weight.dtype == torch.float8_e4m3fn and lin.weight.nbytes * 2 == w.nbytes
    assert torch.equal(lin.dense_weight(), w)
    x = torch.randn(3, 4, 256, generator=g).to(torch.bfloat16)
    assert torch.equal(lin(x[:, 0]), ref(x[:, 0]))
    x2 = torch.randn(5, 2, 256, generator=g).to(torch.bfloat16)
    assert torch.equal(grouped_output(x2, lin, 2), grouped_output(x2, ref, 2))


@pytest.mark.parametrize("rows,groups,r,k,split", [(1, 2, 128, 384, None), (5, 4, 64, 256, 2), (40, 2, 256, 512, 4),
                                                   (70, 1, 128, 256, None)])
def test_grouped_rows_kernel_matches_the_dense_einsum(device, rows, groups, r, k, split):
    """Each group's rows times its slice of the e4m3 weight, block scales applied per 128×128, K split
    over programs: the einsum over the widened weight, to the bf16 output's rounding (a wrong group,
    block or scale is off by far more)."""
    g = torch.Generator().manual_seed(rows + groups)
    w = _widened(groups * r, k, g)
    q, s = fp8_exact.exact_fp8(w)
    x = (torch.randn(rows, groups, k, generator=g)).to(torch.bfloat16)
    cfg = fp8_exact.rows_config(rows, groups * r, k)
    if split:
        cfg["SPLIT_K"] = split
    got = fp8_exact.grouped_rows(x.to(device), q.to(device), s.to(device), config=cfg, force_kernel=True).cpu()
    want = torch.einsum("tgd,grd->tgr", x.double(), w.double().view(groups, r, k))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, groups, r)
    assert rel_rms(want, got) < 4e-3
    again = fp8_exact.grouped_rows(x.to(device), q.to(device), s.to(device), config=cfg, force_kernel=True).cpu()
    assert torch.equal(got, again)                 # split order fixed: run to run identical
