"""Packed KV entry formats: exact round trips of values the model already quantised."""

import torch

from hybridkv.cache.formats import (index_entry_bytes, main_entry_bytes, pack_index_fp4, pack_main_fp8,
                                    unpack_index_fp4, unpack_main_fp8)
from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip


def test_sizes_match_spec():
    assert main_entry_bytes(512, 64) == 584 and index_entry_bytes(128) == 68
    assert main_entry_bytes(96, 32) == 136


def test_main_fp8_round_trip_exact():
    x = torch.randn(50, 512) * torch.logspace(-3, 2, 50).unsqueeze(1)
    x = torch.cat([fp8_round_trip(x[:, :448], 64), x[:, 448:].bfloat16().float()], 1)
    buf = pack_main_fp8(x, 64)
    assert buf.shape == (50, 584) and buf.dtype == torch.uint8
    assert torch.equal(unpack_main_fp8(buf, 512, 64), x)
    assert (buf[:, 583] == 0).all()  # the pad byte


def test_index_fp4_round_trip_exact():
    x = fp4_round_trip(hadamard_transform(torch.randn(40, 128)), 32)
    buf = pack_index_fp4(x)
    assert buf.shape == (40, 68)
    assert torch.equal(unpack_index_fp4(buf, 128), x)
