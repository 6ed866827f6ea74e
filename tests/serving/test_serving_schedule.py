"""Schedule structure and flattening, worked out by hand; config and request validation."""

from __future__ import annotations

import numpy as np
import pytest

from serving.core.schedule import PENDING, flatten
from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import AttentionGroup, SchedulerConfig
from serving.core.sequence import Sequence
from serving.sample.sampling_params import SamplingParams


def _config(**overrides: object) -> SchedulerConfig:
    kwargs: dict = dict(
        max_num_seqs=4, max_num_batched_tokens=8, max_prefill_chunk=4, max_model_len=32,
        page_size=4, num_slots=5, groups=(("swa", 5, 20),),
    )  # fmt: skip
    kwargs.update(overrides)
    return SchedulerConfig(**kwargs)


def test_two_steps_by_hand() -> None:
    scheduler = Scheduler(_config())
    a = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=10))
    b = Sequence("b", [10, 11, 12], SamplingParams(max_tokens=10))
    scheduler.add(a)
    scheduler.add(b)
    assert scheduler.config.ring_widths == (3,)  # min(ceil(32/4), 1 + ceil((5+4-2)/4))

    s1 = scheduler.schedule()
    assert s1.num_decodes == 0 and [e.seq for e in s1.entries] == [a, b]
    ea, eb = s1.entries
    assert (ea.token_ids, ea.start, ea.num_tokens, ea.is_first_chunk) == ((1, 2, 3, 4), 0, 4, True)
    assert (ea.slot, ea.samples) == (1, False)
    assert [r.tolist() for r in ea.ring_rows] == [[1, 0, 0]] and ea.slot_mappings == ((4, 5, 6, 7),)
    assert (eb.token_ids, eb.slot) == ((10, 11, 12), 2)
    assert [r.tolist() for r in eb.ring_rows] == [[2, 0, 0]] and eb.slot_mappings == ((8, 9, 10),)
    assert eb.samples
    f = flatten(s1)
    assert f.token_ids.tolist() == [1, 2, 3, 4, 10, 11, 12]
    assert f.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert f.cu_seqlens.tolist() == [0, 4, 7] and f.query_lens.tolist() == [4, 3]
    assert f.seq_lens.tolist() == [4, 3] and f.slot_ids.tolist() == [1, 2]
    assert f.has_initial.tolist() == [False, False] and f.sample_mask.tolist() == [False, True]
    assert f.page_tables[0].tolist() == [[1, 0, 0], [2, 0, 0]]
    assert f.slot_mappings[0].tolist() == [4, 5, 6, 7, 8, 9, 10]
    assert f.logits_indices.tolist() == [3, 6] and f.num_decodes == 0
    assert all(x.dtype == np.int32 for x in (f.token_ids, f.positions, f.cu_seqlens, f.slot_ids))
    outputs = scheduler.update(s1, [-1, 99])
    assert [(o.seq, o.new_token_ids, o.finished) for o in outputs] == [(b, [99], False)]
    assert a.num_computed_tokens == 4 and b.output_token_ids == [99]

    s2 = scheduler.schedule()  # b decodes first, then a's last prompt chunk
    assert s2.num_decodes == 1 and [e.seq for e in s2.entries] == [b, a]
    f = flatten(s2)
    assert f.token_ids.tolist() == [99, 5, 6] and f.positions.tolist() == [3, 4, 5]
    assert f.cu_seqlens.tolist() == [0, 1, 3] and f.seq_lens.tolist() == [4, 6]
    assert f.has_initial.tolist() == [True, True] and f.sample_mask.tolist() == [True, True]
    assert f.page_tables[0].tolist() == [[2, 0, 0], [1, 3, 0]]
    assert f.slot_mappings[0].tolist() == [11, 12, 13] and f.logits_indices.tolist() == [0, 2]
    scheduler.update(s2, [7, 8])
    assert a.output_token_ids == [8] and b.output_token_ids == [99, 7]

    s3 = scheduler.schedule()  # a (older) then b; b's token 4 needs a new page
    assert [e.seq for e in s3.entries] == [a, b] and s3.num_decodes == 2
    assert s3.entries[1].ring_rows[0].tolist() == [2, 4, 0]
    scheduler.update(s3, [1, 1])
    s4 = scheduler.schedule()
    scheduler.update(s4, [1, 1])
    # a has 8 tokens cached; the next query (8) reads keys 4..8: logical page 0 was freed.
    assert a.num_computed_tokens == 8 and a.rings[0].first == 1 and list(a.rings[0].pages) == [3]
    assert 1 not in scheduler.groups[0].pool.in_use()
    # Its next page (logical 2, column 2) reuses the page just freed: the pool is a stack.
    assert flatten(scheduler.schedule()).page_tables[0][0].tolist() == [0, 3, 1]


def test_empty_schedule_flattens_to_empty_arrays() -> None:
    scheduler = Scheduler(_config())
    schedule = scheduler.schedule()
    assert schedule.is_empty and schedule.num_tokens == 0
    f = flatten(schedule)
    assert f.token_ids.shape == (0,) and f.cu_seqlens.tolist() == [0]
    assert f.page_tables[0].shape == (0, 3)
    assert scheduler.update(schedule, []) == []


def test_budget_chunk_and_max_num_seqs_are_respected() -> None:
    scheduler = Scheduler(_config(max_num_seqs=2))
    for i in range(4):
        scheduler.add(Sequence(f"r{i}", list(range(1, 11)), SamplingParams(max_tokens=2)))
    schedule = scheduler.schedule()
    assert [e.num_tokens for e in schedule.entries] == [4, 4]
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    assert schedule.num_tokens <= 8


def test_schedule_update_protocol_is_enforced() -> None:
    scheduler = Scheduler(_config())
    scheduler.add(Sequence("a", [1, 2], SamplingParams(max_tokens=2)))
    schedule = scheduler.schedule()
    # The overlapped loop: the next step is scheduled before this one's token is known.
    second = scheduler.schedule()
    assert second.entries[0].token_ids == (PENDING,) and second.entries[0].samples
    assert scheduler.get("a").is_exhausted  # max_tokens=2: both tokens are pending
    with pytest.raises(RuntimeError, match="two Schedules"):
        scheduler.schedule()
    with pytest.raises(ValueError, match="number of entries"):
        scheduler.update(schedule, [1, 2])
    with pytest.raises(RuntimeError, match="oldest"):
        scheduler.update(second, [1])
    assert scheduler.update(schedule, [7])[0].new_token_ids == [7]
    with pytest.raises(RuntimeError, match="oldest"):
        scheduler.update(schedule, [1])
    out = scheduler.update(second, [8])
    assert out[0].finished and scheduler.get("a") is None
    assert scheduler.schedule().is_empty


def test_add_validates_requests() -> None:
    scheduler = Scheduler(_config())
    with pytest.raises(ValueError, match="max_model_len=32"):
        scheduler.add(Sequence("long", [1] * 20, SamplingParams(max_tokens=13)))
    scheduler.add(Sequence("ok", [1] * 20, SamplingParams(max_tokens=12)))
    with pytest.raises(ValueError, match="already queued"):
        scheduler.add(Sequence("ok", [1], SamplingParams()))
    with pytest.raises(ValueError, match="must not be empty"):
        Sequence("empty", [])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 3}, "max_num_batched_tokens"),
        ({"max_prefill_chunk": 9}, "max_prefill_chunk"),
        ({"page_size": 0}, "page_size"),
        ({"num_slots": 1}, "num_slots"),
        ({"groups": (("swa", 0, 20),)}, "window"),
        ({"groups": (("swa", 5, 2),)}, "num_pages"),  # a decode with window 5 needs 3 pages
        ({"groups": (("g", None, 8),)}, "num_pages"),  # 32 tokens need 8 pages + the dummy
        ({"groups": (("g", None, 9), ("g", 4, 9))}, "unique"),
        ({"groups": (("g", None),)}, "name, window"),
    ],
)
def test_config_validation_names_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_config_accepts_plain_tuples_and_smallest_pools() -> None:
    config = _config(groups=[("swa", 5, 4), ("g", None, 9)])
    assert config.groups == (AttentionGroup("swa", 5, 4), AttentionGroup("g", None, 9))
    assert config.ring_widths == (3, 8)


def test_preemption_takes_the_newest_and_admits_nobody_that_step() -> None:
    # Global group, 4 usable pages of 4 tokens. a and b grow in lockstep; when a needs
    # its third page none is free: b (newest) is preempted and requeued at the front
    # of waiting (ahead of c, held back by max_num_seqs), and nobody is admitted in
    # that step although b's chunk would fit in the page left free.
    config = _config(max_model_len=16, max_num_seqs=2, groups=(("g", None, 5),))
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=12)
    a, b, c = Sequence("a", [1] * 3, params), Sequence("b", [2] * 3, params), Sequence("c", [3], params)
    for seq in (a, b):
        scheduler.add(seq)
    schedule = scheduler.schedule()
    scheduler.update(schedule, [1, 1])
    scheduler.add(c)
    while not (schedule := scheduler.schedule()).preempted:
        assert [e.seq for e in schedule.entries] == [a, b]  # c waits: max_num_seqs
        scheduler.update(schedule, [1] * schedule.num_seqs)
    assert schedule.preempted == (b,) and [e.seq for e in schedule.entries] == [a]
    # a: 8 tokens computed before, + the one this schedule commits
    assert a.num_computed_tokens == 9 and b.num_preemptions == 1 and scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [b, c] and b.num_computed_tokens == 0 and b.slot == 0
    assert scheduler.stats().pages_in_use == {"g": 3} and scheduler.stats().slots_in_use == 1
    scheduler.update(schedule, [1])
    schedule = scheduler.schedule()  # b comes back first, recomputing prompt + its 5 outputs
    assert [e.seq for e in schedule.entries] == [a, b]
    assert schedule.entries[1].is_first_chunk and schedule.entries[1].num_tokens == 4
    assert schedule.entries[1].token_ids == (2, 2, 2, 1)


def test_a_partial_prefill_that_does_not_fit_waits_with_its_pages() -> None:
    # 4 usable pages of 4 tokens. a decodes; p is mid-prefill. In the step where a
    # takes the last free page, p cannot get one: it is skipped, not preempted
    # (only decodes preempt themselves), and keeps its two pages.
    config = _config(max_model_len=16, max_num_seqs=2, groups=(("g", None, 5),))
    scheduler = Scheduler(config)
    a = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=13))
    p = Sequence("p", list(range(1, 13)), SamplingParams(max_tokens=4))
    scheduler.add(a)
    scheduler.add(p)
    for expected in ([(a, 3), (p, 4)], [(a, 1), (p, 4)], [(a, 1)]):
        schedule = scheduler.schedule()
        assert [(e.seq, e.num_tokens) for e in schedule.entries] == expected
        scheduler.update(schedule, [1] * schedule.num_seqs)
    assert not schedule.preempted and p.num_computed_tokens == 8 and p.rings[0].num_held == 2
    assert scheduler.stats().pages_in_use == {"g": 4}
