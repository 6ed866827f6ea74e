"""The scheduler end to end with a fake runner whose tokens are computable by hand."""

from __future__ import annotations

import dataclasses
import random

import pytest
from serving_fakes import FakeRunner, drive, reference_tokens, step

from serving.core.scheduler import Scheduler
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import FinishReason, Sequence, SequenceStatus
from serving.sample.sampling_params import SamplingParams

S = 4  # page size
LEN = 96  # max_model_len


def _config(**overrides: object) -> SchedulerConfig:
    kwargs: dict = dict(
        max_num_seqs=8,
        max_num_batched_tokens=16,
        max_prefill_chunk=7,
        max_model_len=LEN,
        page_size=S,
        num_slots=9,
        groups=(("swa", 8, 200), ("global", None, 400)),
    )
    kwargs.update(overrides)
    return SchedulerConfig(**kwargs)


def _windows(config: SchedulerConfig) -> tuple[int | None, ...]:
    return tuple(g.window for g in config.groups)


def _requests(count: int, seed: int, max_prompt: int = 40) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randint(1, max_prompt))]
        out.append((prompt, rng.randint(1, min(30, LEN - len(prompt)))))
    return out


def _serve(config: SchedulerConfig, requests: list[tuple[list[int], int]]) -> tuple:
    scheduler, runner = Scheduler(config), FakeRunner(config)
    seqs = [
        Sequence(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
        for i, (prompt, max_tokens) in enumerate(requests)
    ]
    drive(scheduler, runner, seqs)
    return scheduler, runner, seqs


def _assert_all_free(scheduler: Scheduler) -> None:
    stats = scheduler.stats()
    assert stats.slots_in_use == 0 and not scheduler.running and not scheduler.waiting
    assert all(used == 0 for used in stats.pages_in_use.values()), stats


def test_batch_outputs_equal_solo_outputs_and_reference() -> None:
    config = _config()
    requests = _requests(32, seed=0)
    scheduler, _, seqs = _serve(config, requests)
    assert scheduler.num_preemptions == 0
    for (prompt, max_tokens), seq in zip(requests, seqs, strict=True):
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, _windows(config))
        assert seq.finish_reason is FinishReason.LENGTH and seq.prompt_token_ids == prompt
    for (prompt, max_tokens), seq in list(zip(requests, seqs, strict=True))[:6]:
        _, _, (solo,) = _serve(config, [(prompt, max_tokens)])
        assert solo.output_token_ids == seq.output_token_ids
    _assert_all_free(scheduler)


@pytest.mark.parametrize(
    "groups",
    [
        (("global", None, LEN // S + 1),),  # one sequence's worth of pages
        (("swa", 8, 6), ("global", None, LEN // S + 6)),
        (("swa", 13, 6),),
    ],
)
def test_tiny_page_pool_forces_preemptions_and_outputs_stay_identical(groups: tuple) -> None:
    config = _config(groups=groups, max_prefill_chunk=16)
    requests = _requests(12, seed=1, max_prompt=60)
    scheduler, _, seqs = _serve(config, requests)
    assert scheduler.num_preemptions > 0
    assert sum(seq.num_preemptions for seq in seqs) == scheduler.num_preemptions
    for (prompt, max_tokens), seq in zip(requests, seqs, strict=True):
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, _windows(config))
    _assert_all_free(scheduler)


def test_slots_are_reused_across_100_requests_without_leaking_state() -> None:
    config = _config(num_slots=3, max_num_seqs=2)
    requests = _requests(100, seed=2, max_prompt=12)
    scheduler, runner, seqs = _serve(config, requests)
    assert runner.slots_seen == {1, 2}
    for (prompt, max_tokens), seq in zip(requests, seqs, strict=True):
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, _windows(config))
    _assert_all_free(scheduler)


def test_5000_token_sequence_through_the_scheduler_window_64() -> None:
    config = SchedulerConfig(
        max_num_seqs=2, max_num_batched_tokens=96, max_prefill_chunk=96, max_model_len=5000,
        page_size=16, num_slots=3, groups=(("swa", 64, 8),),
    )  # fmt: skip
    prompt = [(7 * i) % 1000 + 1 for i in range(1000)]
    scheduler, runner = Scheduler(config), FakeRunner(config)
    seq = Sequence("long", prompt, SamplingParams(max_tokens=4000))
    peak = 0
    scheduler.add(seq)
    while scheduler.has_unfinished():  # check_invariants asserts the bound after every step
        step(scheduler, runner)
        peak = max(peak, scheduler.stats().pages_in_use["swa"])
    assert peak <= 5  # ceil(63 / 16) + 1
    assert seq.output_token_ids == reference_tokens(prompt, 4000, (64,))
    _assert_all_free(scheduler)


def test_abort_frees_pages_and_slot_at_once() -> None:
    config = _config(max_num_seqs=3, num_slots=4)
    requests = _requests(6, seed=3)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(requests)]
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(4):
        step(scheduler, runner)
    victim = scheduler.running[0]
    before = scheduler.stats()
    held = [r.num_held for r in victim.rings]
    assert scheduler.abort(victim.request_id) is victim
    after = scheduler.stats()
    assert after.slots_in_use == before.slots_in_use - 1 and victim.slot == 0
    assert [before.pages_in_use[g] - after.pages_in_use[g] for g in ("swa", "global")] == held
    assert victim.finish_reason is FinishReason.ABORT and victim.status is SequenceStatus.FINISHED
    waiting = scheduler.waiting[-1]
    assert scheduler.abort(waiting.request_id) is waiting and waiting not in scheduler.waiting
    assert scheduler.abort(victim.request_id) is None and scheduler.abort("nope") is None
    # Abort between schedule() and update(): the entry is skipped, nothing leaks.
    schedule = scheduler.schedule()
    in_flight = next(e.seq for e in schedule.entries if e.samples)
    frozen = (in_flight.num_computed_tokens, in_flight.output_token_ids)
    tokens = runner.run(schedule)
    scheduler.abort(in_flight.request_id)
    outputs = scheduler.update(schedule, tokens)
    assert in_flight not in [o.seq for o in outputs]
    assert (in_flight.num_computed_tokens, in_flight.output_token_ids) == frozen
    drive(scheduler, runner)
    done = [s for s in seqs if s not in (victim, waiting, in_flight)]
    for seq in done:
        prompt, max_tokens = requests[seqs.index(seq)]
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, _windows(config))
    _assert_all_free(scheduler)


PROMPT = [5, 17, 900, 3, 44]


def _run_one(params: SamplingParams, eos: tuple[int, ...] = ()) -> Sequence:
    config = _config()
    scheduler = Scheduler(config, eos_token_ids=eos)
    seq = Sequence("x", PROMPT, params)
    drive(scheduler, FakeRunner(config), [seq])
    return seq


def _ref(n: int = 30) -> list[int]:
    out = reference_tokens(PROMPT, n, _windows(_config()))
    assert len(set(out[:4])) == 4, "pick a prompt whose first tokens differ"
    return out


def test_max_tokens_finishes_with_length() -> None:
    seq = _run_one(SamplingParams(max_tokens=5))
    assert seq.output_token_ids == _ref()[:5] and seq.finish_reason is FinishReason.LENGTH


def test_eos_finishes_with_stop_and_keeps_the_token() -> None:
    ref = _ref()
    seq = _run_one(SamplingParams(max_tokens=20), eos=(ref[3],))
    assert seq.output_token_ids == ref[:4]
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason is None


def test_ignore_eos_runs_to_max_tokens() -> None:
    ref = _ref()
    seq = _run_one(SamplingParams(max_tokens=20, ignore_eos=True), eos=(ref[3],))
    assert seq.output_token_ids == ref[:20] and seq.finish_reason is FinishReason.LENGTH


def test_stop_token_ids_finish_with_the_token_as_stop_reason() -> None:
    ref = _ref()
    seq = _run_one(SamplingParams(max_tokens=20, stop_token_ids=[ref[2]]))
    assert seq.output_token_ids == ref[:3]
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == ref[2]


def test_min_tokens_holds_back_eos_and_stop_ids() -> None:
    ref = _ref()
    seq = _run_one(SamplingParams(max_tokens=9, min_tokens=9, stop_token_ids=[ref[0]]), (ref[1],))
    assert seq.output_token_ids == ref[:9] and seq.finish_reason is FinishReason.LENGTH
    seq = _run_one(SamplingParams(max_tokens=20, min_tokens=3), eos=(ref[1], ref[2]))
    assert seq.output_token_ids == ref[:3] and seq.finish_reason is FinishReason.STOP
    seq = _run_one(SamplingParams(max_tokens=20, min_tokens=3, stop_token_ids=[ref[0], ref[3]]))
    assert seq.output_token_ids == ref[:4] and seq.stop_reason == ref[3]


def test_eos_on_the_last_allowed_token_is_a_stop() -> None:
    ref = _ref()
    seq = _run_one(SamplingParams(max_tokens=4), eos=(ref[3],))
    assert seq.output_token_ids == ref[:4] and seq.finish_reason is FinishReason.STOP


def test_engine_finish_for_a_stop_string_frees_everything() -> None:
    config = _config()
    scheduler, runner = Scheduler(config), FakeRunner(config)
    seq = Sequence("x", PROMPT, SamplingParams(max_tokens=20, stop=["zz"]))
    scheduler.add(seq)
    for _ in range(3):
        step(scheduler, runner)
    scheduler.finish(seq, FinishReason.STOP, stop_reason="zz")
    assert seq.finish_reason is FinishReason.STOP and seq.stop_reason == "zz"
    assert not scheduler.has_unfinished()
    scheduler.finish(seq, FinishReason.ABORT)  # already finished: no effect
    assert seq.finish_reason is FinishReason.STOP
    _assert_all_free(scheduler)


def test_fcfs_with_one_running_sequence() -> None:
    config = _config(max_num_seqs=1)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    seqs = [Sequence(f"r{i}", [i + 1] * (10 - i), SamplingParams(max_tokens=3)) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    order = []
    while scheduler.has_unfinished():
        for out in scheduler.update(s := scheduler.schedule(), runner.run(s)):
            if out.finished:
                order.append(out.seq.request_id)
    assert order == [f"r{i}" for i in range(5)]


def test_pure_ssm_model_without_attention_groups() -> None:
    config = _config(groups=())
    requests = _requests(10, seed=4)
    scheduler, _, seqs = _serve(config, requests)
    for (prompt, max_tokens), seq in zip(requests, seqs, strict=True):
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, ())
    _assert_all_free(scheduler)


def test_admission_interval_and_lowered_limits_keep_outputs() -> None:
    """admission_interval_steps: while sequences run, a waiting one is admitted only 4+ steps after the
    last admission or when 3 wait; set_limits: at most 2 running and 8 tokens a step until
    lifted. Prompts arrive one every other step; every output equals the reference."""
    config = dataclasses.replace(_config(), admission_interval_steps=4, admission_batch=3)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    scheduler.set_limits(2, 8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=17"):
        scheduler.set_limits(2, 17)
    requests = _requests(24, seed=5)
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(requests)]
    last_admit, n, admitted_early = None, 0, 0
    while n < 400 and (scheduler.has_unfinished() or n // 2 < len(seqs)):
        if n % 2 == 0 and n // 2 < len(seqs):
            scheduler.add(seqs[n // 2])
        if n == 60:
            scheduler.set_limits()
        waiting, running = len(scheduler.waiting), len(scheduler.running)
        schedule = step(scheduler, runner)
        if n < 60:
            assert schedule.num_tokens <= 8 and len(scheduler.running) <= 2
        if any(e.is_first_chunk for e in schedule.entries):
            assert running == 0 or waiting >= 3 or last_admit is None or n - last_admit >= 4, n
            admitted_early += running > 0 and waiting >= 3 and last_admit is not None and n - last_admit < 4
            last_admit = n
        n += 1
    assert not scheduler.has_unfinished() and admitted_early > 0
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (8, 16)
    for (prompt, max_tokens), seq in zip(requests, seqs, strict=True):
        assert seq.output_token_ids == reference_tokens(prompt, max_tokens, _windows(config))
    _assert_all_free(scheduler)


def test_a_step_that_admits_takes_every_waiting_sequence_that_fits() -> None:
    """With admission_interval_steps=4, two prompts that arrived while `a` ran are admitted
    together in the fourth step after a's admission (one mixed step, not one each); with
    the default interval of 1 every step admits."""
    config = dataclasses.replace(_config(), admission_interval_steps=4, admission_batch=8)
    scheduler, runner = Scheduler(config), FakeRunner(config)
    params = SamplingParams(max_tokens=12)
    scheduler.add(Sequence("a", [1, 2, 3], params))
    admitted = [[e.seq.request_id for e in step(scheduler, runner).entries if e.is_first_chunk]]
    scheduler.add(Sequence("b", [4, 5], params))
    scheduler.add(Sequence("c", [6, 7], params))
    for _ in range(4):
        admitted.append([e.seq.request_id for e in step(scheduler, runner).entries if e.is_first_chunk])
    assert admitted == [["a"], [], [], [], ["b", "c"]]
