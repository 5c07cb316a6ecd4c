"""The decode window-row kernel against the composition it replaces: FP8 round trip of the nope
dims, `pack_main_fp8`, an indexed store into the ring."""

import pytest
import torch

from hybridkv.config import KV_FP8_BLOCK
from hybridkv.ops.kv_formats import main_entry_bytes, pack_main_fp8
from hybridkv.ops.quant.reference import fp8_round_trip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [128, 512])
def test_window_rows_are_packed_and_stored_as_the_composition(device, dtype, d):
    from hybridkv.ops.window import triton as kernels
    g = torch.Generator().manual_seed(d)
    b, rope, w = 5, 64, 16
    kv = torch.randn(b, d, generator=g) * torch.logspace(-3, 2, b)[:, None]
    kv[1, :64] = 0                                  # an all-zero block: the amax floor
    kv[2, :64] = torch.linspace(-1, 1, 64) * 225.0 / 448.0 * 2.0 ** -3   # a block whose round trip halves its scale
    kv[2, 5] = 225.0 * 2.0 ** -3
    kv = kv.to(dtype)
    slots = torch.tensor([2, 0, 3, 1, 4])
    positions = torch.tensor([17, 3, 40, 15, 0])
    nbytes = main_entry_bytes(d, rope)
    ring = torch.randint(0, 255, (5, w, nbytes), generator=g, dtype=torch.uint8)
    want_ring = ring.clone()
    want = pack_main_fp8(torch.cat([fp8_round_trip(kv[:, :-rope], KV_FP8_BLOCK), kv[:, -rope:]], -1), rope)
    want_ring[slots, positions % w] = want
    dev = [t.to(device) for t in (kv, ring, slots, positions)]
    got = kernels.write_window_fp8(*dev, rope)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(dev[1].cpu(), want_ring)
    # rows already round-tripped pack to the same bytes (the trip is idempotent)
    again = kernels.write_window_fp8(torch.cat([fp8_round_trip(kv[:, :-rope], KV_FP8_BLOCK), kv[:, -rope:]],
                                               -1).to(device), *dev[1:], rope)
    assert torch.equal(again.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v41_window_rows_are_packed_and_stored_as_the_composition(device, dtype):
    from hybridkv.ops.kv_formats import pack_v41_window, v41_window_bytes
    from hybridkv.ops.window import triton as kernels
    g = torch.Generator().manual_seed(41)
    b, d, w = 5, 512, 16
    kv = torch.randn(b, d, generator=g) * torch.logspace(-3, 2, b)[:, None]
    kv[1, :32] = 0                                  # an all-zero block: the amax floor
    kv[1, 32:64] = -0.0
    kv[2, :32] = torch.linspace(-1, 1, 32) * 225.0 / 448.0 * 2.0 ** -3   # a round trip that halves its scale
    kv[2, 5] = 225.0 * 2.0 ** -3
    kv[3, 64:96] = torch.linspace(-1, 1, 32) * 1e-3
    kv[3, 70] = 40.0                                # small negative values round to −0 (0x80)
    kv = kv.to(dtype)
    slots = torch.tensor([2, 0, 3, 1, 4])
    positions = torch.tensor([17, 3, 40, 15, 0])
    ring = torch.randint(0, 255, (5, w, v41_window_bytes(d)), generator=g, dtype=torch.uint8)
    want_ring = ring.clone()
    want = pack_v41_window(fp8_round_trip(kv, 32))
    assert (want[:, :d] == 0x80).any()
    want_ring[slots, positions % w] = want
    dev = [t.to(device) for t in (kv, ring, slots, positions)]
    got = kernels.write_window_v41(*dev, 32)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(dev[1].cpu(), want_ring)
    again = kernels.write_window_v41(fp8_round_trip(kv, 32).to(device), *dev[1:], 32)   # the trip is idempotent
    assert torch.equal(again.cpu(), want)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype,ring_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                              (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_float_window_rows_are_stored_as_the_composition(device, pow2, dtype, ring_dtype):
    """A float store's window row (`write_window_float`): the nope dims' FP8 round trip (in the
    rows' dtype, as the model runs it), the rope dims kept, cast to the ring's dtype, to the bit."""
    from hybridkv.ops.window import triton as kernels
    g = torch.Generator().manual_seed(7)
    b, d, rope, w = 5, 128, 64, 16
    kv = torch.randn(b, d, generator=g) * torch.logspace(-3, 2, b)[:, None]
    kv[1, :64] = 0                                  # an all-zero block: the amax floor
    kv[3, 64:] *= 1e3                               # rope dims far from the nope dims' scale
    kv = kv.to(dtype)
    slots = torch.tensor([2, 0, 3, 1, 4])
    positions = torch.tensor([17, 3, 40, 15, 0])
    ring = torch.randn(5, w, d, generator=g).to(ring_dtype)
    want = torch.cat([fp8_round_trip(kv[:, :-rope], KV_FP8_BLOCK, pow2), kv[:, -rope:]], -1).to(ring_dtype)
    want_ring = ring.clone()
    want_ring[slots, positions % w] = want
    dev = [t.to(device) for t in (kv, ring, slots, positions)]
    got = kernels.write_window_float(*dev, rope, pow2)
    assert got.dtype == ring_dtype and torch.equal(got.cpu(), want)
    assert torch.equal(dev[1].cpu(), want_ring)


def test_window_writers_check_the_ring():
    from hybridkv.ops.window import write_window_float
    kv = torch.zeros(2, 128)
    with pytest.raises(ValueError, match="float rows"):
        write_window_float(kv, torch.zeros(3, 8, 128, dtype=torch.uint8), torch.zeros(2, dtype=torch.long),
                           torch.zeros(2, dtype=torch.long), 64, True)


@pytest.mark.parametrize("window", [8, 12])
def test_window_listing_kernel_lists_what_the_reference_lists(device, window):
    """`window_listing`'s one launch: ring rows oldest first and their validity, for tokens before
    the window fills, past it, and windows that start late (a bounded replay), −1 starts included."""
    from hybridkv.ops.backend import use_triton
    from hybridkv.ops.window import triton as kernels
    from hybridkv.ops.window import window_listing
    positions = torch.tensor([0, 5, 11, 12, 40, 41])
    start = torch.tensor([0, 0, 3, -1, 35, 41])
    assert not use_triton(positions) or device == "cuda"
    want = window_listing(positions, window, start)              # the plain-torch composition on the CPU
    got = kernels.window_listing(positions.to(device), window, start.to(device))
    assert got[0].dtype == torch.long and got[1].dtype == torch.bool
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    # the reference itself: position 11 reads 4..11 of window 8 (valid from 3), wrapping in the ring
    if window == 8:
        assert want[0][2].tolist() == [4, 5, 6, 7, 0, 1, 2, 3] and want[1][2].all()
        assert want[1][0].tolist() == [True] + [False] * 7 and want[1][5].tolist() == [False] * 7 + [True]


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_rows_round_tripped_in_one_launch_equal_the_composition(device, monkeypatch, pow2, dtype):
    """`round_trip_window_rows` (rows the attention keeps where no fused store takes them: prefill
    chunks, the MTP block): the nope dims' round trip and the rope dims kept, in the rows' dtype,
    to the bit, for [T, D] and [B, T, D] rows."""
    from hybridkv.ops.window import round_trip_window_rows
    from hybridkv.ops.window import triton as kernels
    g = torch.Generator().manual_seed(11)
    kv = (torch.randn(2, 3, 128, generator=g) * torch.logspace(-2, 2, 3)[None, :, None]).to(dtype)
    kv[0, 1, :64] = 0
    want = torch.cat([fp8_round_trip(kv[..., :-64], KV_FP8_BLOCK, pow2), kv[..., -64:]], -1)
    got = kernels.round_trip_rows(kv.reshape(-1, 128).to(device), 64, pow2).view(kv.shape).cpu()
    assert got.dtype == dtype and torch.equal(got, want)
    if device == "cpu":
        monkeypatch.setenv("HYBRIDKV_KERNELS", "triton")
    assert torch.equal(round_trip_window_rows(kv.to(device), 64, pow2).cpu(), want)
