"""The shared expert's decode path: w1 and w3 paired in one buffer and read by one packed FP8
GEMM, the SwiGLU in one launch; against the expert's torch operations."""

import pytest
import torch

from helpers import rel_rms
from hybridkv.model.linear import paired_weights
from hybridkv.model import linear
from hybridkv.model.moe import Expert
from hybridkv.ops import grouped_moe
from hybridkv.ops.quant import quant_fp8_weight
from hybridkv.weights import iter_state


@pytest.mark.parametrize("limit", [0.0, 7.0])
@pytest.mark.parametrize("with_weights", [False, True])
def test_swiglu_kernel_matches_the_torch_ops(device, limit, with_weights):
    g = torch.Generator().manual_seed(int(limit) + with_weights)
    both = (torch.randn(5, 2 * 300, generator=g) * 6).to(device)
    gate, up = both[:, :300], both[:, 300:]                 # column slices of one GEMM output
    w = torch.rand(5, 1, generator=g).to(device) if with_weights else None
    got = grouped_moe.swiglu(gate, up, limit, w, torch.bfloat16)
    gf, uf = gate.float(), up.float()
    if limit:
        uf, gf = uf.clamp(-limit, limit), gf.clamp(max=limit)
    want = torch.nn.functional.silu(gf) * uf
    want = (w * want if w is not None else want).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (5, 300)
    # float32 exp implementations differ by an ulp; bf16 rounding hides nearly all of it
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all()
    assert (got != want).float().mean() < 0.01


def test_paired_w1_w3_read_by_one_gemm_equal_two(device, monkeypatch):
    with torch.device(device):
        ex = Expert(256, 384, "fp8", torch.float32, (128, 128), 7.0, paired=True)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for lin in (ex.w1, ex.w2, ex.w3):
            q, s = quant_fp8_weight(torch.randn(lin.weight.shape, generator=g) * 0.05)
            lin.weight.copy_(q)
            lin.scale.copy_(s)
    pair = paired_weights(ex.w1, ex.w3)
    assert pair is not None and pair[0].shape == (768, 256) and pair[0].data_ptr() == ex.w1.weight.data_ptr()
    assert torch.equal(pair[0][384:].view(torch.uint8), ex.w3.weight.view(torch.uint8))
    assert torch.equal(pair[1][3:].float(), ex.w3.scale.float())
    x = torch.randn(4, 256, generator=g).to(device)
    with torch.no_grad():
        monkeypatch.setenv("HYBRIDKV_KERNELS", "reference")
        want = ex(x)
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
        reads = []
        real = linear.packed_fp8_linear
        monkeypatch.setattr(linear, "packed_fp8_linear",
                            lambda x, w, s, dt, block: reads.append(w.shape) or real(x, w, s, dt, block))
        got = ex(x)
    assert reads == [(768, 256), (256, 384)]       # w1 and w3 in one GEMM, then w2
    assert rel_rms(want, got) < 1e-5
    # a checkpoint holds each projection's own bytes
    state = dict(iter_state(ex))
    assert state["w1.weight"].shape == (384, 256) and torch.equal(state["w3.weight"].view(torch.uint8), ex.w3.weight.cpu().view(torch.uint8))
