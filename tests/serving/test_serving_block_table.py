"""Ring arithmetic of per-sequence pages with sliding-window recycling."""

from __future__ import annotations

import math

import pytest

from serving.core.block_table import KVGroup, PageRing, decode_page_bound, ring_width


def _needed_range(window: int | None, s: int, n: int, c: int) -> range:
    lo = 0 if window is None else max(0, n - window + 1) // s
    return range(lo, (n + c - 1) // s + 1)


@pytest.mark.parametrize("s", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [1, 2, 5, 16, 17, 40, None])
@pytest.mark.parametrize("chunk", [1, 3, 16, 33])
def test_ring_width_is_the_tight_bound(s: int, window: int | None, chunk: int) -> None:
    max_model_len = 120
    worst = max(
        len(_needed_range(window, s, n, c))
        for n in range(max_model_len)
        for c in range(1, min(chunk, max_model_len - n) + 1)
    )
    assert ring_width(window, s, chunk, max_model_len) == worst
    worst_decode = max(len(_needed_range(window, s, n, 1)) for n in range(max_model_len))
    assert decode_page_bound(window, s, max_model_len) == worst_decode
    if window is not None:
        assert worst_decode <= math.ceil((window - 1) / s) + 1


def _group(window: int | None, num_pages: int, s: int, chunk: int = 96, length: int = 5000):
    return KVGroup("g", window, num_pages, page_size=s, max_chunk=chunk, max_model_len=length)


def _check_row_and_mapping(group: KVGroup, ring: PageRing, n: int, c: int) -> None:
    row = group.row(ring).tolist()
    s, width = group.page_size, group.width
    assert len(row) == width
    held_columns = {i % width for i in ring.logical_pages()}
    assert len(held_columns) == ring.num_held, "held pages collide in the ring"
    assert all(row[col] == 0 for col in range(width) if col not in held_columns)
    mapping = group.slot_mapping(ring, n, c)
    assert mapping == [row[(p // s) % width] * s + p % s for p in range(n, n + c)]
    lo = group.first_needed(n)
    for q in range(n, n + c):  # every key of every query in this step is reachable
        for k in range(max(0, q - group.window + 1) if group.window else 0, q + 1):
            assert row[(k // s) % width] != 0 and k // s >= lo


def test_5000_token_sequence_window_64_stays_within_bound() -> None:
    s, window, chunk = 16, 64, 96
    group = _group(window, num_pages=40, s=s, chunk=chunk)
    ring = group.new_ring()
    bound = math.ceil((window - 1) / s) + 1
    n, prompt, total = 0, 1000, 5000
    seen_pages: set[int] = set()
    while n < total:
        c = min(chunk, prompt - n) if n < prompt else 1
        assert group.pages_needed(ring, n, c) <= group.pool.num_free
        group.allocate(ring, n, c)
        assert ring.num_held <= group.width
        if c == 1:
            assert ring.num_held <= bound
        _check_row_and_mapping(group, ring, n, c)
        seen_pages.update(ring.pages)
        n += c
        group.release(ring, n)
        assert ring.num_held <= bound
        assert ring.logical_pages() == range(group.first_needed(n), math.ceil(n / s))
        assert group.pool.num_used == ring.num_held, "a freed page did not return to the pool"
    # 313 logical pages went through a pool of 39: pages were recycled.
    assert math.ceil(total / s) > group.pool.capacity and len(seen_pages) <= group.pool.capacity
    group.free(ring)
    assert ring.num_held == 0 and group.pool.num_free == group.pool.capacity


def test_global_group_keeps_every_page_and_fills_the_row_in_order() -> None:
    s = 4
    group = _group(None, num_pages=11, s=s, chunk=8, length=40)
    assert group.width == 10
    ring = group.new_ring()
    n = 0
    for c in (8, 8, 3, 1, 1, 1):
        group.allocate(ring, n, c)
        _check_row_and_mapping(group, ring, n, c)
        n += c
        assert group.release(ring, n) == 0
        assert ring.num_held == math.ceil(n / s) and ring.first == 0
    assert group.row(ring)[: ring.num_held].tolist() == list(ring.pages)


def test_window_one_frees_everything_at_page_boundaries() -> None:
    group = _group(1, num_pages=3, s=4, chunk=4, length=40)
    ring = group.new_ring()
    group.allocate(ring, 0, 4)
    assert group.release(ring, 4) == 1 and ring.num_held == 0 and ring.first == 1
    group.allocate(ring, 4, 1)
    assert list(ring.logical_pages()) == [1]
    _check_row_and_mapping(group, ring, 4, 1)


@pytest.mark.parametrize("window", [3, 10, None])
def test_max_chunk_is_the_largest_chunk_whose_pages_are_free(window: int | None) -> None:
    s = 4
    for n in range(0, 30):
        for free in range(0, 6):
            group = _group(window, num_pages=60, s=s, chunk=64, length=200)
            ring = group.new_ring()
            if n:
                group.allocate(ring, 0, n)
                group.release(ring, n)
            group.pool.allocate_many(group.pool.num_free - free)  # leave `free` pages
            fits = [c for c in range(1, 40) if group.pages_needed(ring, n, c) <= free]
            best = max(fits, default=0)
            assert max(0, group.max_chunk(ring, n)) == best, (n, free)
