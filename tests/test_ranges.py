"""`hybridkv.ops.ranges.arange`: the ranges torch.arange gives, for one and two bounds and each
dtype asked, served as views of one cached tensor that grows when a longer range is asked; a
tensor it outgrows stays alive (a captured graph reads it by address)."""

import weakref

import torch

from hybridkv.ops import ranges


def test_cached_ranges_equal_torch_arange_and_share_one_tensor():
    ranges._RANGES.clear()
    a = ranges.arange(5, device="cpu")
    assert torch.equal(a, torch.arange(5)) and a.dtype == torch.long
    assert torch.equal(ranges.arange(3, 9, device="cpu"), torch.arange(3, 9))
    b = ranges.arange(7, device="cpu")
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
    first = weakref.ref(a._base)
    del a, b
    longer = ranges.arange(10000, device="cpu")                 # past the cached length: made anew, longer
    assert torch.equal(longer, torch.arange(10000))
    assert first() is not None and torch.equal(first()[:5], torch.arange(5))   # the outgrown one kept
    a = ranges.arange(5, device="cpu")
    assert ranges.arange(2, device="cpu").untyped_storage().data_ptr() == longer.untyped_storage().data_ptr()
    small = ranges.arange(4, dtype=torch.int32, device="cpu")
    assert small.dtype == torch.int32 and torch.equal(small, torch.arange(4, dtype=torch.int32))
