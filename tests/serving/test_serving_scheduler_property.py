"""Property test: random admissions, aborts, finishes and chunk sizes never break the
pools. After every schedule() and every update(): no page or slot held twice, none
lost (free + held == capacity), index 0 never handed out, every SWA sequence within
its page bound and holding exactly its window's pages; sequences that ran to their
own end produced exactly the fake model's tokens; and everything drains."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serving_fakes import FakeRunner, drive, reference_tokens, step

from serving.core.block_table import decode_page_bound
from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import FinishReason, Sequence
from serving.sample.sampling_params import SamplingParams


@st.composite
def configs(draw: st.DrawFn) -> SchedulerConfig:
    page_size = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(4, 48))
    max_num_seqs = draw(st.integers(1, 5))
    budget = draw(st.integers(max_num_seqs, 24))
    windows = draw(st.lists(st.one_of(st.none(), st.integers(1, 30)), max_size=2))
    groups = []
    for i, window in enumerate(windows):
        need = decode_page_bound(window, page_size, max_model_len)
        groups.append((f"g{i}", window, need + 1 + draw(st.integers(0, need))))
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_prefill_chunk=draw(st.integers(1, budget)),
        max_model_len=max_model_len,
        page_size=page_size,
        num_slots=draw(st.integers(2, max_num_seqs + 2)),
        groups=tuple(groups),
    )


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), data=st.data())
def test_random_workload_keeps_pool_invariants(config: SchedulerConfig, data: st.DataObject):
    eos = 7
    scheduler, runner = Scheduler(config, eos_token_ids=[eos]), FakeRunner(config)
    windows = tuple(g.window for g in config.groups)
    seqs: list[Sequence] = []
    interfered: set[str] = set()  # aborted or finished by the "engine"
    for _ in range(data.draw(st.integers(1, 30), label="steps")):
        for _ in range(data.draw(st.integers(0, 2), label="adds")):
            prompt_len = data.draw(st.integers(1, config.max_model_len - 1))
            prompt = data.draw(st.lists(st.integers(0, 1008), min_size=prompt_len,
                                        max_size=prompt_len))  # fmt: skip
            max_tokens = data.draw(st.integers(1, config.max_model_len - prompt_len))
            params = SamplingParams(max_tokens=max_tokens,
                                    min_tokens=data.draw(st.integers(0, max_tokens)))  # fmt: skip
            seqs.append(Sequence(f"r{len(seqs)}", prompt, params))
            scheduler.add(seqs[-1])
        live = [s for s in seqs if not s.is_finished]
        if live and data.draw(st.booleans(), label="interfere"):
            seq = data.draw(st.sampled_from(live))
            if data.draw(st.booleans(), label="abort"):
                assert scheduler.abort(seq.request_id) is seq
            else:
                scheduler.finish(seq, FinishReason.STOP, stop_reason="stop string")
            interfered.add(seq.request_id)
        step(scheduler, runner)
    drive(scheduler, runner, max_steps=10_000)

    for seq in seqs:
        assert seq.is_finished and seq.slot == 0
        assert all(r.num_held == 0 for r in seq.rings)
        if seq.request_id in interfered:
            continue
        ref = reference_tokens(seq.prompt_token_ids, seq.params.max_tokens, windows)
        assert seq.output_token_ids == ref[: seq.num_output_tokens]
        if seq.finish_reason is FinishReason.LENGTH:
            assert seq.num_output_tokens == seq.params.max_tokens
        else:
            assert seq.output_token_ids[-1] == eos
            assert seq.num_output_tokens >= max(1, seq.params.min_tokens)
    stats = scheduler.stats()
    event(f"preempted: {stats.num_preemptions > 0}")
    assert stats.slots_in_use == 0 and not any(stats.pages_in_use.values())


def test_bound_formula_matches_the_brief() -> None:
    for window in range(1, 80):
        for s in (1, 4, 16):
            bound = decode_page_bound(window, s, 10_000)
            assert bound <= math.ceil((window - 1) / s) + 1
