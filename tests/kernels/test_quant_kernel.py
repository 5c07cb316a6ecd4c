"""The one-launch FP8 round trip (power-of-two and plain amax/448 scales) against its plain-torch
definition: bit-identical."""

import pytest
import torch

from hybridkv.ops.quant import reference
from hybridkv.ops.quant import triton as kernels


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,shape", [(64, (3, 448)), (128, (37, 2, 512)), (32, (1, 96))])
def test_fp8_round_trip_is_bit_identical(device, dtype, block, shape, pow2):
    g = torch.Generator().manual_seed(block)
    x = torch.randn(shape, generator=g) * torch.logspace(-6, 4, shape[-1] // block).repeat_interleave(block)
    x[0, ..., :block] = 0.0                                     # a block at the amax floor
    x.view(-1)[5] = 1e6                                         # saturates against ±448 after scaling
    x = x.to(dtype).to(device)
    want = reference.fp8_round_trip(x, block, pow2=pow2)
    got = kernels.fp8_round_trip(x, block, pow2)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block,scale_fmt,shape", [(32, "ue8m0", (3, 2, 128)), (16, "e4m3", (5, 512)),
                                                   (32, "e4m3", (1, 64))])
def test_fp4_round_trip_is_bit_identical(device, dtype, block, scale_fmt, shape):
    g = torch.Generator().manual_seed(block)
    # (amax below 448 · 6: torch converts a larger e4m3 scale to 448 from 2.13 on, to NaN before; the
    # kernel saturates)
    x = torch.randn(shape, generator=g) * torch.logspace(-12, 2, shape[-1] // block).repeat_interleave(block)
    x[0, ..., :block] = 0.0                                     # a block at the amax floor
    x.view(-1)[-block:] = torch.tensor([0.25, -1.25, 2.5, 5.0]).repeat(block // 4)   # ties of the E2M1 grid
    x = x.to(dtype).to(device)
    want = reference.fp4_round_trip(x, block, scale_fmt)
    got = kernels.fp4_round_trip(x, block, scale_fmt)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert torch.equal(got, want)
