"""PagePool / SlotPool: index 0 never handed out, misuse raises, nothing lost."""

from __future__ import annotations

import pytest

from serving.core.pools import PagePool, PoolError, SlotPool


def test_hands_out_every_index_but_the_dummy_once() -> None:
    pool = PagePool(num_pages=6, page_size=4)
    got = [pool.allocate() for _ in range(5)]
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert pool.num_free == 0 and pool.num_used == 5 and pool.capacity == 5
    with pytest.raises(PoolError, match="empty"):
        pool.allocate()


def test_free_returns_index_and_it_is_reused_first() -> None:
    pool = SlotPool(num_slots=4)
    a, b = pool.allocate(), pool.allocate()
    pool.free(a)
    assert pool.num_free == 2 and pool.num_used == 1 and pool.in_use() == {b}
    assert pool.allocate() == a


@pytest.mark.parametrize(("index", "message"), [(0, "dummy"), (7, "foreign"), (-1, "foreign")])
def test_freeing_dummy_or_foreign_index_raises(index: int, message: str) -> None:
    pool = SlotPool(num_slots=7)
    with pytest.raises(PoolError, match=message):
        pool.free(index)


def test_double_free_raises_and_leaves_pool_consistent() -> None:
    pool = PagePool(num_pages=3, page_size=2)
    i = pool.allocate()
    pool.free(i)
    with pytest.raises(PoolError, match="double free"):
        pool.free(i)
    assert pool.num_free == 2 and pool.num_used == 0


def test_free_of_never_allocated_index_raises() -> None:
    pool = PagePool(num_pages=4, page_size=2)
    with pytest.raises(PoolError, match="double free"):
        pool.free(2)


def test_allocate_many_is_all_or_nothing() -> None:
    pool = PagePool(num_pages=4, page_size=2)
    with pytest.raises(PoolError):
        pool.allocate_many(4)
    assert pool.num_free == 3
    assert sorted(pool.allocate_many(3)) == [1, 2, 3]


@pytest.mark.parametrize("size", [0, 1, True, 2.0])
def test_bad_sizes_are_rejected(size: object) -> None:
    with pytest.raises(ValueError, match="size"):
        SlotPool(size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="page_size"):
        PagePool(4, page_size=0)
