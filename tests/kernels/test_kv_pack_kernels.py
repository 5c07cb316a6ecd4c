"""The decode step's packing kernels against the plain-torch packings: the same bytes."""

import pytest
import torch

from hybridkv.ops import kv_formats
from hybridkv.ops.kv_formats import triton as kernels
from hybridkv.ops.quant.reference import fp4_round_trip, fp8_round_trip


def _rows(n: int, d: int, tile: int, seed: int) -> torch.Tensor:
    # (below 448 · 6 / 4: torch converts larger e4m3 scales by saturating from 2.13 on, to NaN before)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-8, 2, n)[:, None]
    x[0, :tile] = 0.0                                        # an all-zero block: the amax floor
    return x


@pytest.mark.parametrize("d", [128, 512])
def test_index_keys_pack_to_the_same_bytes(device, d):
    x = _rows(6, d, 32, d)
    on_grid = fp4_round_trip(x, 32)
    for rows in (on_grid, x):            # the indexer's keys, and rows off the grid (codes truncated)
        want = kv_formats.pack_index_fp4(rows)
        assert torch.equal(kernels.pack_index_fp4(rows.to(device), 32).cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_window_rows_pack_to_the_same_bytes(device, dtype):
    x = _rows(5, 512, 32, 7)
    x[2, :32] = torch.linspace(-1, 1, 32) * 225.0 / 448.0 * 2.0 ** -3    # a round trip that halves the scale
    x[2, 5] = 225.0 * 2.0 ** -3
    rows = fp8_round_trip(x, 32).to(dtype)
    want = kv_formats.pack_v41_window(rows)
    assert torch.equal(kernels.pack_v41_window(rows.to(device), 32).cpu(), want)
    assert torch.equal(kv_formats.unpack_v41_window(want, 512, dtype), rows)


def test_v41_global_entries_pack_to_the_same_bytes_and_scales_are_searched(device):
    x = _rows(7, 512, 16, 11)
    # small blocks: e4m3(amax / 6) is subnormal and rounds up, the largest value lands on 4, and
    # quant_fp4 would pick a smaller scale again
    x[3, :16] = torch.linspace(-1, 1, 16) * 0.01875
    x[4, 16:32] = torch.linspace(-1, 1, 16) * 0.019
    rows = fp4_round_trip(x, 16, "e4m3")
    blocks = rows.reshape(7, 32, 16)
    q, s = kv_formats.quant_fp4(rows, 16, "e4m3")
    searched = int((~(q.reshape(7, 32, 16) * s.unsqueeze(-1) == blocks).all(-1)).sum())
    assert searched > 0                   # some block's scale is not the one quant_fp4 picks again
    want = kv_formats.pack_v41_global(rows)
    got, failed = kernels.pack_v41_global(rows.to(device), 16)
    assert torch.equal(got.cpu(), want) and not failed.any()
    assert torch.equal(kv_formats.unpack_v41_global(want, 512), rows)
    # values off the grid: no scale fits; both keep quant_fp4's codes, and the check refuses them
    off = x.clone()
    want = kv_formats.pack_v41_global(off, check=False)
    got, failed = kernels.pack_v41_global(off.to(device), 16)
    assert torch.equal(got.cpu(), want) and failed.cpu().gt(0).any()
    with pytest.raises(ValueError, match="not on the FP4 grid"):
        kv_formats.pack_v41_global(off)


@pytest.mark.parametrize("kind", ["index", "v41_global"])
def test_entries_packed_into_a_paged_pool_land_where_the_block_tables_say(device, kind, monkeypatch):
    """`pack_into_pool` (a decode step's entry writes): every row packed as the packings pack it, at
    entry ids[n] of request which[n] through its block table (the indexer keys' block layout: a
    block's codes first, then its scales); rows with id −1 leave the pool's bytes as they were."""
    d, tile, per = (128, 32, 8) if kind == "index" else (512, 16, 4)
    layout = kind == "index"
    x = _rows(5, d, tile, 3)
    rows = fp4_round_trip(x, 32) if layout else fp4_round_trip(x, 16, "e4m3")
    pack = kv_formats.pack_index_fp4 if layout else kv_formats.pack_v41_global
    width = pack(rows[:1]).shape[1]
    g = torch.Generator().manual_seed(4)
    pool = torch.randint(0, 256, (6, per, width), generator=g, dtype=torch.uint8)
    tables = torch.tensor([[3, 0, 5], [1, 4, 2], [2, 2, 2]], dtype=torch.int32)
    which = torch.tensor([0, 1, 1, 0, 2], dtype=torch.int32)
    ids = torch.tensor([per + 2, 0, -1, 2 * per + per - 1, 1])
    want = pool.clone()
    codes, scales = kv_formats.index_block_views(want, d) if layout else (None, None)
    for n in range(5):
        if ids[n] < 0:
            continue
        blk, slot = int(tables[which[n], ids[n] // per]), int(ids[n] % per)
        packed = pack(rows[n:n + 1])[0]
        if layout:
            codes[blk, slot], scales[blk, slot] = packed[: d // 2], packed[d // 2:]
        else:
            want[blk, slot] = packed
    got = pool.to(device)
    monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")        # the kernels' dispatch (the interpreter on the CPU)
    assert kv_formats.pack_into_pool(rows.to(device), kind, got, tables.to(device), which.to(device),
                                     ids.to(device), layout)
    assert torch.equal(got.cpu(), want)
