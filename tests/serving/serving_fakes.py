"""Test helpers: a fake model whose next token is computable by hand, a fake
runner that executes a Schedule through its flattened arrays the way the real
runner will (write K/V through slot mappings, read windows through ring page
tables, carry per-slot state), and the scheduler invariant checker.

The fake model, for a sequence of tokens x_0..x_q (q = last position):
  state = fold of (state * 31 + x_k + 1) % V over k = 0..q     (the "SSM", per slot)
  h_g   = sum over keys k in group g's window of (k % 7 + 1) * x_k   (the "attention")
  next  = (state + sum_g (g + 1) * h_g + 3 q) % V
A scheduler bug (wrong page table, slot mapping, first-chunk flag, slot reuse,
lost tokens on preemption) changes the tokens, or trips an assertion in the runner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

from serving.core.block_table import KVGroup
from serving.core.schedule import Schedule, flatten
from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import Sequence, SequenceStatus

VOCAB = 1009


def _state_step(state: int, token: int) -> int:
    return (state * 31 + token + 1) % VOCAB


def _window_lo(window: int | None, q: int) -> int:
    return 0 if window is None else max(0, q - window + 1)


def _next_token(state: int, windows: tuple[int | None, ...], q: int, read: Callable) -> int:
    h = 0
    for g, window in enumerate(windows):
        h += (g + 1) * sum((k % 7 + 1) * read(g, k) for k in range(_window_lo(window, q), q + 1))
    return (state + h + 3 * q) % VOCAB


def reference_tokens(prompt: list[int], num_out: int, windows: tuple[int | None, ...]) -> list[int]:
    """The first `num_out` tokens the fake model generates after `prompt`, without the engine."""
    tokens = list(prompt)
    state = 0
    for t in tokens[:-1]:
        state = _state_step(state, t)
    out = []
    for _ in range(num_out):
        state = _state_step(state, tokens[-1])
        nxt = _next_token(state, windows, len(tokens) - 1, lambda g, k: tokens[k])
        out.append(nxt)
        tokens.append(nxt)
    return out


class FakeRunner:
    """Runs Schedules on numpy 'device' buffers: K/V token stores per group, state per slot."""

    def __init__(self, config: SchedulerConfig) -> None:
        s = config.page_size
        self.page_size = s
        self.windows = tuple(g.window for g in config.groups)
        self.kv = [np.full(g.num_pages * s, -1, dtype=np.int64) for g in config.groups]
        self.state = np.zeros(config.num_slots, dtype=np.int64)
        self.slots_seen: set[int] = set()

    def run(self, schedule: Schedule) -> list[int]:
        a = flatten(schedule)
        s = self.page_size
        for g, kv in enumerate(self.kv):
            assert (a.slot_mappings[g] >= s).all(), "a live token was written to the dummy page"
            assert len(set(a.slot_mappings[g].tolist())) == len(a.slot_mappings[g])
            kv[a.slot_mappings[g]] = a.token_ids
        out = []
        for i, entry in enumerate(schedule.entries):
            lo, hi = int(a.cu_seqlens[i]), int(a.cu_seqlens[i + 1])
            slot = int(a.slot_ids[i])
            assert slot > 0
            self.slots_seen.add(slot)
            state = int(self.state[slot]) if a.has_initial[i] else 0
            for j in range(lo, hi):
                state = _state_step(state, int(a.token_ids[j]))
            self.state[slot] = state
            truth = entry.seq.token_ids

            def read(g: int, k: int, i: int = i) -> int:
                table = a.page_tables[g][i]
                page = int(table[(k // s) % table.shape[0]])
                assert page > 0, f"key {k} of group {g} maps to the dummy page"
                return int(self.kv[g][page * s + k % s])

            for j in range(lo, hi):  # every query must see exactly its window
                q = int(a.positions[j])
                for g, window in enumerate(self.windows):
                    for k in range(_window_lo(window, q), q + 1):
                        assert read(g, k) == truth[k], (entry.seq, g, q, k)
            q = int(a.positions[hi - 1])
            out.append(_next_token(state, self.windows, q, read) if a.sample_mask[i] else -1)
        return out


def drive(
    scheduler: Scheduler,
    runner: FakeRunner,
    seqs: Iterable[Sequence] = (),
    *,
    max_steps: int = 100_000,
    check: bool = True,
) -> int:
    """Add `seqs`, then step until nothing is unfinished. Returns the number of steps."""
    for seq in seqs:
        scheduler.add(seq)
    steps = 0
    while scheduler.has_unfinished():
        step(scheduler, runner, check=check)
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    return steps


def step(scheduler: Scheduler, runner: FakeRunner, *, check: bool = True) -> Schedule:
    schedule = scheduler.schedule()
    if check:
        check_schedule(scheduler, schedule)
        check_invariants(scheduler, in_step=True)
    scheduler.update(schedule, runner.run(schedule))
    if check:
        check_invariants(scheduler, in_step=False)
    return schedule


def check_schedule(scheduler: Scheduler, schedule: Schedule) -> None:
    """Step limits and batch order: decodes first, budget, chunk and batch size."""
    cfg = scheduler.config
    entries = schedule.entries
    assert schedule.num_tokens <= cfg.max_num_batched_tokens
    assert schedule.num_seqs <= cfg.max_num_seqs
    assert len({e.seq.request_id for e in entries}) == len(entries)
    assert all(e.num_tokens == 1 and e.start > 0 and e.samples for e in entries[: schedule.num_decodes])
    for e in entries:
        assert e.seq.status is SequenceStatus.RUNNING and e.slot == e.seq.slot
        # Work is committed when scheduled: computed tokens include this step's.
        assert e.num_tokens >= 1 and e.start + e.num_tokens == e.seq.num_computed_tokens
        assert e.samples == (e.start + e.num_tokens == e.seq.num_tokens + e.seq.num_pending - e.samples)
        assert e.num_tokens <= cfg.max_prefill_chunk or e in entries[: schedule.num_decodes]
    if schedule.preempted:  # no admission in a step that preempted
        assert not any(e.is_first_chunk for e in entries)


def _check_group(scheduler: Scheduler, gi: int, group: KVGroup, in_step: bool) -> None:
    pool = group.pool
    held: list[int] = []
    for seq in scheduler.running:
        ring = seq.rings[gi]
        held.extend(ring.pages)
        assert ring.num_held <= group.width, (seq, ring.num_held, group.width)
        columns = {i % group.width for i in ring.logical_pages()}
        assert len(columns) == ring.num_held, "two held pages share a ring column"
        expect_row = [0] * group.width
        for i, page in zip(ring.logical_pages(), ring.pages, strict=True):
            expect_row[i % group.width] = page
        assert group.row(ring).tolist() == expect_row, "the ring row is out of date"
        if not in_step:
            n = seq.num_computed_tokens
            assert ring.num_held <= group.decode_bound, (seq, ring.num_held)
            # Exactly the pages the next query reads, nothing out of window.
            expect = range(group.first_needed(n), -(-n // group.page_size))
            assert ring.logical_pages() == expect, (seq, ring.first, expect)
    assert 0 not in held, "the dummy page was handed out"
    assert len(held) == len(set(held)), "a page is held twice"
    assert set(held) == pool.in_use(), "a page was lost (used by the pool, held by nobody)"
    free = pool._free
    assert len(free) == len(set(free)) and not set(free) & set(held)
    assert pool.num_free + pool.num_used == pool.capacity


def check_invariants(scheduler: Scheduler, *, in_step: bool) -> None:
    """No page or slot held twice or lost, index 0 never handed out, SWA page bounds."""
    running = scheduler.running
    assert len(running) <= scheduler.config.max_num_seqs
    assert [s.arrival for s in running] == sorted(s.arrival for s in running)
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    slots = [s.slot for s in running]
    assert 0 not in slots and len(slots) == len(set(slots)), slots
    assert set(slots) == scheduler.slots.in_use()
    assert scheduler.slots.num_free + scheduler.slots.num_used == scheduler.slots.capacity
    assert [s.arrival for s in scheduler.waiting] == sorted(s.arrival for s in scheduler.waiting)
    for seq in scheduler.waiting:
        assert seq.status is SequenceStatus.WAITING and seq.slot == 0
        assert seq.num_computed_tokens == 0 and all(r.num_held == 0 for r in seq.rings)
    for gi, group in enumerate(scheduler.groups):
        _check_group(scheduler, gi, group, in_step)
