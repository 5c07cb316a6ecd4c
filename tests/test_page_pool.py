"""The device page pool of offload mode: the same pages in the same order as the block pool gives
uncached blocks, many at once without a Python call per page, and no page lost or given twice."""

import random

import pytest

from hybridkv.cache.block_pool import BlockPool, OutOfBlocks
from hybridkv.cache.page_pool import PagePool


def test_pages_come_and_go_in_the_order_the_block_pool_gives_uncached_blocks():
    pages, blocks, rng = PagePool(40), BlockPool(40), random.Random(3)
    held_p, held_b = [], []
    for _ in range(400):
        if held_p and rng.random() < 0.45:
            i = rng.randrange(len(held_p))
            pages.release(held_p.pop(i))
            blocks.release(held_b.pop(i))
        elif pages.num_free:
            held_p.append(pages.allocate())
            held_b.append(blocks.allocate())
        assert held_p == held_b and pages.num_free == blocks.num_free
    pages.check()


def test_many_at_once_equals_one_at_a_time():
    one, many = PagePool(30), PagePool(30)
    a = [one.allocate() for _ in range(12)]
    assert many.allocate_many(12) == a
    for p in (a[3], a[7], a[0]):
        one.release(p)
    many.release_many([a[3], a[7], a[0]])
    assert [one.allocate() for _ in range(5)] == many.allocate_many(5)
    assert one.num_used == many.num_used == 14
    many.check()


def test_too_many_takes_nothing_and_bad_releases_are_refused():
    pool = PagePool(4)
    taken = pool.allocate_many(3)
    with pytest.raises(OutOfBlocks):
        pool.allocate_many(2)
    assert pool.num_free == 1
    with pytest.raises(RuntimeError, match="not taken"):
        pool.release_many([taken[0], taken[0]])       # twice in one call
    with pytest.raises(RuntimeError, match="not taken"):
        pool.release(pool._free[0])                   # a free page
    assert pool.num_free == 1                          # a refused release frees nothing
    pool.release_many(taken)
    assert pool.num_free == 4 and pool.allocate_many(0) == []
    pool.check()
