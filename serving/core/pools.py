"""Integer pools for KV pages and recurrent-state slots.

A pool hands out indices into a device array that the runner owns: pages
index the page axis of `[k, num_pages, s, e]` K/V arrays of one attention
group; slots index the leading axis of every per-slot state buffer. The pools
know nothing of devices, sequences or windows: they only guarantee that an
index is held by at most one owner at a time and that none is lost.

Index 0 of every pool is the dummy that padded rows read and write; it is never
handed out, so `capacity == size - 1`. JAX clamps out-of-range indices
silently, so misuse (double free, foreign index, allocating from an empty pool)
raises `PoolError` here on the host instead of corrupting another sequence.

`PageCache` puts reference counts and keys over a page pool for prefix caching: a
keyed page may be held by several sequences (read-only: it is full), and an idle keyed
page stays cached until an allocation evicts it (serving/core/prefix_cache.py).
"""

from __future__ import annotations

from collections import OrderedDict

DUMMY_INDEX = 0


class PoolError(RuntimeError):
    """An internal invariant of a pool was broken (a bug in the caller, not bad input)."""


class IndexPool:
    """Hands out ints in [1, size): index 0 is reserved as the dummy.

    Free indices are kept as a stack, so the most recently freed index is
    handed out first: reuse is immediate, which makes stale-state bugs in the
    runner (a slot not reset, a page not overwritten) show up quickly in tests.
    """

    def __init__(self, size: int, name: str = "pool") -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 2:
            raise ValueError(f"{name}: {size=} must be an int >= 2 (index 0 is the dummy)")
        self.name = name
        self.size = size
        self._free: list[int] = list(range(size - 1, DUMMY_INDEX, -1))
        self._used: set[int] = set()

    @property
    def capacity(self) -> int:
        """Indices that can be handed out (size - 1)."""
        return self.size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def in_use(self) -> frozenset[int]:
        """A snapshot of the indices currently handed out."""
        return frozenset(self._used)

    def allocate(self) -> int:
        """Hand out one free index (never 0). Raises PoolError when empty."""
        if not self._free:
            raise PoolError(f"{self.name}: allocate from an empty pool (size {self.size})")
        index = self._free.pop()
        self._used.add(index)
        return index

    def allocate_many(self, count: int) -> list[int]:
        """Hand out `count` indices at once, or raise PoolError and hand out none."""
        if count < 0 or count > len(self._free):
            raise PoolError(f"{self.name}: cannot allocate {count}, {len(self._free)} free")
        return [self.allocate() for _ in range(count)]

    def free(self, index: int) -> None:
        """Give `index` back. Raises PoolError for the dummy, a foreign index or a double free."""
        if index == DUMMY_INDEX:
            raise PoolError(f"{self.name}: free of the dummy index 0")
        if not 0 < index < self.size:
            raise PoolError(f"{self.name}: free of foreign index {index} (size {self.size})")
        if index not in self._used:
            raise PoolError(f"{self.name}: double free of index {index}")
        self._used.remove(index)
        self._free.append(index)


class PagePool(IndexPool):
    """KV pages of one attention group: `num_pages` includes the dummy page 0.

    `page_size` (s, tokens per page) is kept here so that slot mappings
    (`page * s + offset`, an index into the flattened `[num_pages * s]` token
    axis) can be computed by whoever holds the pool.
    """

    def __init__(self, num_pages: int, page_size: int, name: str = "pages") -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"{name}: {page_size=} must be an int >= 1")
        super().__init__(num_pages, name)
        self.page_size = page_size

    @property
    def num_pages(self) -> int:
        return self.size


class SlotPool(IndexPool):
    """Recurrent-state slots: `num_slots` includes the dummy slot 0."""

    def __init__(self, num_slots: int, name: str = "slots") -> None:
        super().__init__(num_slots, name)

    @property
    def num_slots(self) -> int:
        return self.size


class PageCache:
    """Reference counts, keys and the idle LRU over one group's `PagePool`.

    With nothing keyed it behaves exactly as the bare pool (prefix caching off).
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # pages held by sequences -> holders
        self.idle: OrderedDict[int, None] = OrderedDict()  # keyed, unreferenced; LRU first
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Pages that an allocation can have: free ones plus idle cached ones."""
        return self.pool.num_free + len(self.idle)

    @property
    def num_held(self) -> int:
        """Pages referenced by at least one sequence."""
        return len(self.refs)

    def take(self, count: int) -> list[int]:
        """`count` pages, each with one reference; evicts idle cached pages when needed."""
        if count < 0 or count > self.num_free:
            raise PoolError(f"{self.pool.name}: cannot allocate {count}, {self.num_free} free")
        out = []
        for _ in range(count):
            if self.pool.num_free:
                page = self.pool.allocate()
            else:
                page, _ = self.idle.popitem(last=False)
                del self.page_of[self.key_of.pop(page)]
                self.evictions += 1
            self.refs[page] = 1
            out.append(page)
        return out

    def share(self, page: int) -> None:
        """Take a reference on a keyed page (a prefix hit)."""
        if page in self.idle:
            del self.idle[page]
            self.refs[page] = 1
        else:
            self.refs[page] += 1

    def put(self, page: int) -> None:
        """Drop a reference; an unreferenced page becomes idle if keyed, else free."""
        n = self.refs[page] - 1
        if n:
            self.refs[page] = n
            return
        del self.refs[page]
        if page in self.key_of:
            self.idle[page] = None
        else:
            self.pool.free(page)

    def register(self, key: bytes, page: int) -> None:
        """Key a held, fully computed page. A key already cached keeps its page."""
        if key in self.page_of or page in self.key_of:
            return
        assert page in self.refs, (page, "only held pages are registered")
        self.page_of[key] = page
        self.key_of[page] = key
