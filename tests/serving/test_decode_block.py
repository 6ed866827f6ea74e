"""The pure decode step planned over columns (`Scheduler._decode_block`) equals the
general path, step for step.

Two schedulers run the same random workload in lockstep: one as shipped, one with the
column path switched off (the general per-sequence path plans every step, the
reference). After every `schedule()` their flattened arrays, entries, pools and rings
must be identical, and after every `update()` their outputs. Workloads: admissions,
aborts, engine-side stops, stop ids, min_tokens, tight pools (preemption), prefix
caching, and the overlapped loop (a second schedule before the first is updated, so
decodes carry PENDING tokens). The synchronous runs also execute each schedule on the
fake model (serving_fakes.FakeRunner), whose tokens a wrong page table, slot mapping or
position would change.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_fakes import FakeRunner, check_invariants, check_schedule

from serving.core.block_table import decode_page_bound
from serving.core.schedule import PENDING, Schedule, flatten
from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import FinishReason, Sequence
from serving.sample.sampling_params import SamplingParams

EOS = 7


def _general(config: SchedulerConfig) -> Scheduler:
    """The reference: a scheduler whose every step takes the general path."""
    s = Scheduler(config, eos_token_ids=[EOS])
    s._decode_block = lambda: None
    return s


def _entry_view(e) -> tuple:
    return (e.seq.request_id, e.token_ids, e.start, e.slot, tuple(r.tolist() for r in e.ring_rows),
            e.slot_mappings, e.samples, e.out_index, e.restore, e.save, e.num_drafts)


def _same_schedule(a: Schedule, b: Schedule) -> None:
    assert a.num_decodes == b.num_decodes and len(a.entries) == len(b.entries)
    assert [s.request_id for s in a.preempted] == [s.request_id for s in b.preempted]
    assert [_entry_view(e) for e in a.entries] == [_entry_view(e) for e in b.entries]
    fa, fb = flatten(a), flatten(b)
    for f in dataclasses.fields(fa):
        x, y = getattr(fa, f.name), getattr(fb, f.name)
        if isinstance(x, tuple):
            assert len(x) == len(y) and all(np.array_equal(u, v) and u.dtype == v.dtype
                                            for u, v in zip(x, y, strict=True)), f.name
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y) and x.dtype == y.dtype, f.name
        else:
            assert x == y, f.name


def _same_state(a: Scheduler, b: Scheduler, seqs_a: list[Sequence], seqs_b: list[Sequence]) -> None:
    for ga, gb in zip(a.groups, b.groups, strict=True):
        assert ga.pool._free == gb.pool._free  # same free pages in the same order
        assert list(ga.cache.idle) == list(gb.cache.idle)
    assert a.slots.in_use() == b.slots.in_use()
    for x, y in zip(seqs_a, seqs_b, strict=True):
        assert (x.status, x.num_computed_tokens, x.num_pending, x.token_ids, x.slot, x.finish_reason) == (
            y.status, y.num_computed_tokens, y.num_pending, y.token_ids, y.slot, y.finish_reason)
        for r, q in zip(x.rings, y.rings, strict=True):
            assert (r.first, list(r.pages), r.row.tolist()) == (q.first, list(q.pages), q.row.tolist())


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    page_size = draw(st.integers(1, 5))
    max_model_len = draw(st.integers(6, 40))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max_num_seqs, 24))
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 20)), max_size=2))  # [] = pure SSM
    groups = []
    for i, window in enumerate(windows):
        need = decode_page_bound(window, page_size, max_model_len)
        # Tight pools (preemption, the general path's fallback) as well as roomy ones.
        groups.append((f"g{i}", window, need + 1 + draw(st.integers(0, 3 * need))))
    prefix = draw(st.booleans())
    return SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        max_prefill_chunk=draw(st.integers(1, budget)), max_model_len=max_model_len,
        page_size=page_size, num_slots=draw(st.integers(2, max_num_seqs + 2)), groups=tuple(groups),
        prefix_caching=prefix, prefix_state_stride=page_size * draw(st.integers(1, 3)),
        num_checkpoints=draw(st.integers(2, 6)) if prefix else 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
@settings(max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), data=st.data())
def test_column_path_equals_general_path(overlap: bool, config: SchedulerConfig, data: st.DataObject):
    a, b = Scheduler(config, eos_token_ids=[EOS]), _general(config)
    runner_a, runner_b = FakeRunner(config), FakeRunner(config)
    seqs_a: list[Sequence] = []
    seqs_b: list[Sequence] = []
    inflight: list[tuple[Schedule, Schedule]] = []
    shared = data.draw(st.lists(st.integers(0, 1008), min_size=3, max_size=3))  # prefix hits
    blocks = 0

    def resolve() -> None:
        sa, sb = inflight.pop(0)
        if overlap:  # tokens drawn at random (PENDING inputs: the fake model cannot run them)
            toks = data.draw(st.lists(st.sampled_from([EOS, 11, 12, 13, 500]),
                                      min_size=len(sa.entries), max_size=len(sa.entries)))
        else:
            toks = runner_a.run(sa)
            assert runner_b.run(sb) == toks
        out_a, out_b = a.update(sa, toks), b.update(sb, toks)
        assert [(o.seq.request_id, o.new_token_ids, o.finished) for o in out_a] == [
            (o.seq.request_id, o.new_token_ids, o.finished) for o in out_b]
        _same_state(a, b, seqs_a, seqs_b)
        if not overlap and not config.prefix_caching:  # the checker counts no cached pages
            check_invariants(a, in_step=False)

    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        for _ in range(data.draw(st.integers(0, 2), label="adds")):
            n = data.draw(st.integers(1, config.max_model_len - 2))
            prompt = (shared + data.draw(st.lists(st.integers(0, 1008), min_size=n, max_size=n)))[:n]
            max_tokens = data.draw(st.integers(1, config.max_model_len - n))
            params = SamplingParams(max_tokens=max_tokens, min_tokens=data.draw(st.integers(0, max_tokens)),
                                    stop_token_ids=data.draw(st.sampled_from([[], [12]])))
            for seqs, sch in ((seqs_a, a), (seqs_b, b)):
                seqs.append(Sequence(f"r{len(seqs)}", prompt, params))
                sch.add(seqs[-1])
        live = [i for i, s in enumerate(seqs_a) if not s.is_finished]
        if live and data.draw(st.integers(0, 3), label="interfere") == 0:
            i = data.draw(st.sampled_from(live))
            if data.draw(st.booleans(), label="abort"):
                a.abort(seqs_a[i].request_id)
                b.abort(seqs_b[i].request_id)
            else:
                a.finish(seqs_a[i], FinishReason.STOP, "stop string")
                b.finish(seqs_b[i], FinishReason.STOP, "stop string")
        sa, sb = a.schedule(), b.schedule()
        assert sb.block is None
        blocks += sa.block is not None
        _same_schedule(sa, sb)
        _same_state(a, b, seqs_a, seqs_b)
        if not overlap:
            check_schedule(a, sa)
            if not config.prefix_caching:
                check_invariants(a, in_step=True)
        if not sa.is_empty:
            inflight.append((sa, sb))
        if inflight and (not overlap or len(inflight) == 2 or sa.is_empty):
            resolve()
    while inflight:
        resolve()
    event(f"column-path steps: {'some' if blocks else 'none'}")


def test_steady_decode_takes_the_column_path():
    """Four sequences decoding with pages to spare in the overlapped loop: every step
    after the prompts is a DecodeBlock whose tokens are all PENDING."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32,
                             max_model_len=64, page_size=4, num_slots=5,
                             groups=(("swa", 6, 40), ("global", None, 80)))
    sch, runner = Scheduler(config, eos_token_ids=[EOS]), FakeRunner(config)
    for i in range(4):
        sch.add(Sequence(f"r{i}", [20 + i, 30, 40 + i], SamplingParams(max_tokens=20, ignore_eos=True)))
    first = sch.schedule()
    assert first.block is None and first.num_decodes == 0  # the prompts
    sch.update(first, runner.run(first))
    prev, kinds = sch.schedule(), []
    while not prev.is_empty:
        nxt = sch.schedule()  # dispatched before `prev` is resolved
        kinds.append(nxt.block is not None)
        if nxt.block is not None:
            assert (nxt.block.token_ids == PENDING).all() and len(nxt.block) == 4
        sch.update(prev, [13] * len(prev.entries))
        prev = nxt
    assert sum(kinds) == 18 and not sch.has_unfinished(), kinds
