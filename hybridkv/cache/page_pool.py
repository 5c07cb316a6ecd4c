"""Device pages of offloaded CSA blocks (offload mode): which are free, which are taken.

A page holds one KV block's CSA main entries on the device while the memory policy keeps that block
resident. Unlike a KV block (`block_pool`), a page belongs to one request at a time and is never
shared or cached, so it needs no reference count or prefix index: a free stack (the page freed last
is taken first, as `BlockPool` reuses uncached blocks) and a flag per page. A recall takes and frees
hundreds of pages for each of a hundred requests at once, which `allocate_many` and `release_many`
do without a Python call per page.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from hybridkv.cache.block_pool import OutOfBlocks


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError("the page pool needs at least one page")
        self.num_blocks = num_pages
        self._free = list(range(num_pages - 1, -1, -1))      # the end is taken first
        self._used = np.zeros(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks()
        page = self._free.pop()
        self._used[page] = True
        return page

    def allocate_many(self, n: int) -> list[int]:
        """n pages, in the order n calls of `allocate` would give them; none taken if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks()
        if n <= 0:
            return []
        pages = self._free[-n:][::-1]
        del self._free[-n:]
        self._used[pages] = True
        return pages

    def release(self, page: int) -> None:
        if not self._used[page]:
            raise RuntimeError(f"page {page} released but not taken")
        self._used[page] = False
        self._free.append(page)

    def release_many(self, pages: Iterable[int] | np.ndarray) -> None:
        """Free pages as `release` one after another would (the last given is taken first again)."""
        arr = np.asarray(pages, dtype=np.int64).reshape(-1)
        if not arr.size:
            return
        if not self._used[arr].all() or np.unique(arr).size != arr.size:
            bad = next(int(p) for i, p in enumerate(arr) if not self._used[p] or p in arr[:i])
            raise RuntimeError(f"page {bad} released but not taken")
        self._used[arr] = False
        self._free.extend(arr.tolist())

    def check(self) -> None:
        """Raise if the bookkeeping is inconsistent (used by tests)."""
        free = np.asarray(self._free, dtype=np.int64)
        if np.unique(free).size != free.size or self._used[free].any() \
                or int(self._used.sum()) != self.num_blocks - free.size:
            raise AssertionError("page pool: free stack and taken flags disagree")
