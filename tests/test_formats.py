"""Packed KV entry formats: exact round trips of values the model already quantised."""

import pytest
import torch

from hybridkv.ops.hadamard import hadamard_transform
from hybridkv.ops.kv_formats import (index_entry_bytes, main_entry_bytes, pack_index_fp4, pack_main_fp8,
                                     unpack_index_fp4, unpack_main_fp8)
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


def test_index_key_blocks_keep_codes_first():
    """A block of packed keys holds its keys' codes (each 64 aligned bytes at 128 dims), then their
    scales; the row form comes back unchanged, and a store writes and reads that layout."""
    from hybridkv.ops.kv_formats import index_block_rows, index_block_views, index_blocks_to_rows, index_rows_to_blocks
    rows = pack_index_fp4(fp4_round_trip(hadamard_transform(torch.randn(3 * 32, 128)), 32)).view(3, 32, 68)
    blocks = index_rows_to_blocks(rows, 128)
    assert blocks.shape == rows.shape
    assert torch.equal(blocks[1].flatten()[:64], rows[1, 0, :64])               # key 0's codes open the block
    assert torch.equal(blocks[1].flatten()[32 * 64:32 * 64 + 4], rows[1, 0, 64:])  # its scales follow all codes
    assert torch.equal(index_blocks_to_rows(blocks, 128), rows)
    codes, scales = index_block_views(blocks, 128)
    assert torch.equal(codes, rows[..., :64]) and torch.equal(scales, rows[..., 64:])
    b, o = torch.tensor([2, 0, 1]), torch.tensor([31, 7, 0])
    assert torch.equal(index_block_rows(blocks, b, o, 128), rows[b, o])          # rows gathered in place
    codes[2, 5] = 0                                                               # views write through
    assert (blocks[2].flatten()[5 * 64:6 * 64] == 0).all()


def test_v41_packed_entries_round_trip_exactly():
    """Values the V4.1 model stores (global KV: FP4 per 16 with e4m3 scales; window: FP8 per 32 with
    power-of-two scales) pack into 288 + 528 bytes at head_dim 512 and unpack bit for bit."""
    from hybridkv.ops.kv_formats import (pack_v41_global, pack_v41_window, unpack_v41_global, unpack_v41_window,
                                         v41_global_bytes, v41_window_bytes)
    from hybridkv.ops.quant import fp4_round_trip, fp8_round_trip
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 2, 64).unsqueeze(1)
    x[3, :16] = 0                                       # an all-zero block
    glob = fp4_round_trip(x, 16, "e4m3")
    win = fp8_round_trip(x, 32, True)
    assert v41_global_bytes(512) == 288 and v41_window_bytes(512) == 528
    pg, pw = pack_v41_global(glob), pack_v41_window(win)
    assert pg.shape == (64, 288) and pw.shape == (64, 528) and pg.dtype == pw.dtype == torch.uint8
    assert torch.equal(unpack_v41_global(pg, 512), glob)
    assert torch.equal(unpack_v41_window(pw, 512), win)


def test_v41_global_entries_of_tiny_blocks_pack_without_host_reads():
    """Blocks so small that their e4m3 scale is subnormal left their largest value at a magnitude
    below 6: the scale is searched over every magnitude at once. The unchecked form (what a captured
    decode step runs, no host read) packs exactly what the checked one does."""
    from hybridkv.ops.kv_formats import pack_v41_global, unpack_v41_global
    from hybridkv.ops.quant import fp4_round_trip, quant_fp4
    g = torch.Generator().manual_seed(1)
    x = fp4_round_trip(torch.randn(256, 512, generator=g) * torch.logspace(-12, 0, 256).unsqueeze(1), 16, "e4m3")
    q, s = quant_fp4(x, 16, "e4m3")
    again = (q.reshape(256, 32, 16) * s.unsqueeze(-1)).reshape(256, 512)
    assert (again != x).any()                           # quant_fp4 alone does not reproduce some blocks
    checked = pack_v41_global(x)
    assert torch.equal(unpack_v41_global(checked, 512), x)
    assert torch.equal(pack_v41_global(x, check=False), checked)
    with pytest.raises(ValueError, match="not on the FP4 grid"):
        pack_v41_global(x + 1e-3)
