"""Per-sequence KV page bookkeeping for one attention group, with sliding-window recycling.

An attention group is the set of layers that share a window W (W=None: global
attention) and therefore one page pool. A query at position q attends keys
q-W < k <= q. Logical page i of a sequence holds token positions [i*s, (i+1)*s).

The device page table of a group is a RING of width T: logical page i lives in
column i % T of the sequence's row; unused columns hold the dummy page 0. A
kernel finds key k at `row[(k // s) % T] * s + k % s` in the flattened page axis.

Step arithmetic, for a sequence with n tokens in cache about to compute
[n, n + c):
  - it needs logical pages lo(n) .. (n + c - 1) // s, with
    lo(n) = max(0, n - W + 1) // s (0 for global groups);
  - after the step (n' = n + c) every page below lo(n') goes back to the pool.
Held pages are always one contiguous logical range, so a range of at most T
pages lands in distinct ring columns. Bounds on pages held per SWA group:
  - between steps and during decode: ceil((W - 1) / s) + 1;
  - during a chunk of c tokens: 1 + ceil((W + c - 2) / s) (tight).
Ring width (`ring_width`): T = min(ceil(L / s), 1 + ceil((W + C - 2) / s)) for
SWA groups and ceil(L / s) for global groups, with L = max_model_len and C the
largest chunk. Capping at ceil(L / s) is safe because no sequence ever has more
logical pages than that, so the ring never wraps onto a live page.

Pages go through the group's `PageCache` (serving/core/pools.py): reference counts
(a prefix-cache hit shares pages between sequences) and idle cached pages that count
as free. With prefix caching off no page is ever keyed and it is the bare pool.

This module knows pages and token positions only: nothing of tokens, slots,
scheduling policy or devices.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from serving.core.pools import DUMMY_INDEX, PageCache, PagePool


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def ring_width(window: int | None, page_size: int, max_chunk: int, max_model_len: int) -> int:
    """T, the page-table width of a group (see the module docstring)."""
    full = _cdiv(max_model_len, page_size)
    if window is None:
        return full
    return min(full, 1 + _cdiv(window + max_chunk - 2, page_size))


def decode_page_bound(window: int | None, page_size: int, max_model_len: int) -> int:
    """Most pages one sequence holds in a group between steps or in a decode step."""
    full = _cdiv(max_model_len, page_size)
    if window is None:
        return full
    return min(full, _cdiv(window - 1, page_size) + 1)


class PageRing:
    """The pages one sequence holds in one group: logical pages [first, first + len(pages)).

    `row` is the device page-table row (int32 [T]), kept up to date as pages
    come and go so that a step costs O(pages changed), not O(T): global groups
    at long context have wide rows. Mutated only through `KVGroup`; read freely.
    """

    __slots__ = ("first", "pages", "row")

    def __init__(self, width: int) -> None:
        self.first = 0
        self.pages: deque[int] = deque()
        self.row = np.full(width, DUMMY_INDEX, dtype=np.int32)

    @property
    def num_held(self) -> int:
        return len(self.pages)

    @property
    def end(self) -> int:
        """One past the last held logical page."""
        return self.first + len(self.pages)

    def logical_pages(self) -> range:
        return range(self.first, self.end)


class KVGroup:
    """One attention group's page pool plus the ring arithmetic over it.

    Contract for a step of a sequence with `n` cached tokens computing `c` new ones:
    `pages_needed(ring, n, c)` new pages must be free; `allocate(ring, n, c)`
    takes them; `row` and `slot_mapping` describe them to the device; after
    the step `release(ring, n + c)` returns pages that left the window.
    """

    def __init__(
        self,
        name: str,
        window: int | None,
        num_pages: int,
        page_size: int,
        max_chunk: int,
        max_model_len: int,
    ) -> None:
        self.name = name
        self.window = window
        self.page_size = page_size
        self.pool = PagePool(num_pages, page_size, name=f"pages[{name}]")
        self.cache = PageCache(self.pool)
        self.width = ring_width(window, page_size, max_chunk, max_model_len)
        self.decode_bound = decode_page_bound(window, page_size, max_model_len)

    def new_ring(self) -> PageRing:
        return PageRing(self.width)

    def first_needed(self, n: int) -> int:
        """lo(n): the first logical page a query at position n still reads."""
        if self.window is None:
            return 0
        return max(0, n - self.window + 1) // self.page_size

    def _start(self, ring: PageRing, n: int) -> int:
        """First logical page that a step from n would have to allocate."""
        lo = self.first_needed(n)
        if not ring.pages:
            return lo
        assert ring.first <= lo, (ring.first, lo)
        return max(lo, ring.end)

    def pages_needed(self, ring: PageRing, n: int, c: int) -> int:
        """New pages a step computing [n, n + c) must allocate (0 if its pages are held)."""
        last = (n + c - 1) // self.page_size
        return max(0, last + 1 - self._start(ring, n))

    def max_chunk(self, ring: PageRing, n: int) -> int:
        """The most tokens a step from n can compute with the pages free now (may be <= 0)."""
        return (self._start(ring, n) + self.cache.num_free) * self.page_size - n

    def allocate(self, ring: PageRing, n: int, c: int) -> None:
        """Take the pages for computing [n, n + c). Raises PoolError if they are not free."""
        count = self.pages_needed(ring, n, c)
        if not ring.pages:
            ring.first = self.first_needed(n)
        end = ring.end
        for i, page in enumerate(self.cache.take(count), start=end):
            ring.pages.append(page)
            ring.row[i % self.width] = page
        assert ring.num_held <= self.width, (ring.num_held, self.width)

    def attach(self, ring: PageRing, first: int, pages: tuple[int, ...]) -> None:
        """Give an empty ring the cached logical pages [first, first + len(pages)) (shared)."""
        assert not ring.pages and len(pages) <= self.width, (ring.num_held, len(pages))
        ring.first = first
        for i, page in enumerate(pages, start=first):
            self.cache.share(page)
            ring.pages.append(page)
            ring.row[i % self.width] = page

    def release(self, ring: PageRing, n: int) -> int:
        """Free every held page entirely before lo(n), n = tokens now cached. Returns the count."""
        lo = self.first_needed(n)
        freed = 0
        while ring.pages and ring.first < lo:
            self.cache.put(ring.pages.popleft())
            ring.row[ring.first % self.width] = DUMMY_INDEX
            ring.first += 1
            freed += 1
        if not ring.pages:
            ring.first = lo
        return freed

    def free(self, ring: PageRing) -> None:
        """Give every held page back (finish, abort, preemption); cached pages stay idle."""
        while ring.pages:
            self.cache.put(ring.pages.pop())
        ring.first = 0
        ring.row[:] = DUMMY_INDEX

    def row(self, ring: PageRing) -> np.ndarray:
        """A copy of the ring row, int32 [T]: logical page i at column i % T, dummy 0 elsewhere."""
        return ring.row.copy()

    def slot_mapping(self, ring: PageRing, n: int, c: int) -> list[int]:
        """Where tokens [n, n + c) are written: page * s + offset, flattened page axis."""
        s = self.page_size
        first, pages = ring.first, ring.pages
        lo, hi = n // s - first, (n + c - 1) // s - first
        assert c <= 0 or 0 <= lo <= hi < len(pages), (n, c, first, len(pages))
        if c < 64:  # decodes and short chunks: numpy's fixed cost would dominate
            return [pages[pos // s - first] * s + pos % s for pos in range(n, n + c)]
        # A long chunk (8192 tokens: ~4 ms in the loop above on the development CPU).
        held = np.fromiter(itertools.islice(pages, lo, hi + 1), np.int64, count=hi - lo + 1)
        pos = np.arange(n, n + c)
        return (held[pos // s - n // s] * s + pos % s).tolist()
