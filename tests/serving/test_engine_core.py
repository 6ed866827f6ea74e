"""The background engine core: concurrent submits, abort frees at once, bounded queue."""

from __future__ import annotations

import threading
import time

import pytest

from serving.engine.engine_config import EngineConfig
from serving.engine.engine_core import EngineCore, QueueFull
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
                   max_model_len=128, page_size=8)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine("native-tiny", CFG, show_progress=False)


def test_concurrent_streams_equal_sequential_results(engine):
    core = EngineCore(engine).start()
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 5, ignore_eos=True)
                  for i in range(12)]
        prompts = [[3 + i, 4 + i, 5] for i in range(12)]
        want = [[t for d in core.submit(prompt_token_ids=p, params=sp) for t in d.token_ids]
                for p, sp in zip(prompts, params, strict=True)]
        got: dict[int, list[int]] = {}

        def client(i: int) -> None:
            stream = core.submit(prompt_token_ids=prompts[i], params=params[i])
            got[i] = [t for d in stream for t in d.token_ids]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [got[i] for i in range(12)] == want
    finally:
        core.shutdown()


def test_abort_frees_pages_and_slot_and_ends_the_stream(engine):
    core = EngineCore(engine)
    # The loop waits (outside its lock) after the step that produced the first token until
    # the abort is in: otherwise a descheduled test thread could see all 100 tokens out first.
    go = threading.Event()
    core.on_step.append(lambda deltas, dt: deltas and go.wait(timeout=120))
    core.start()
    try:
        stream = core.submit(prompt_token_ids=[5, 6, 7],
                             params=SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        first = stream.get(timeout=300)
        assert not first.finished
        assert core.abort(stream.request_id)
        go.set()
        deltas = list(stream)
        assert deltas[-1].finished and deltas[-1].finish_reason == "abort"
        stats = core.stats()
        assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    finally:
        core.shutdown()


def test_bounded_waiting_queue_rejects_the_excess(engine):
    core = EngineCore(engine, max_waiting=2)  # not started: nothing leaves the queue
    params = SamplingParams(temperature=0.0, max_tokens=2)
    a = core.submit(prompt_token_ids=[1], params=params)
    b = core.submit(prompt_token_ids=[2], params=params)
    with pytest.raises(QueueFull):
        core.submit(prompt_token_ids=[3], params=params)
    core.start()
    try:
        assert list(a)[-1].finished and list(b)[-1].finished
    finally:
        core.shutdown()


def test_shutdown_aborts_what_outlives_the_grace_period(engine):
    core = EngineCore(engine).start()
    stream = core.submit(prompt_token_ids=[5], params=SamplingParams(
        temperature=0.0, max_tokens=120, ignore_eos=True))
    core.shutdown(grace_s=0.0)
    assert list(stream)[-1].finish_reason == "abort"
    assert engine.stats()["slots_in_use"] == 0


def test_a_caller_gets_the_lock_between_two_steps(engine):
    """submit / abort / stats wait at most for the step in progress, never for the loop's
    next steps (Python's lock lets its releasing thread take it straight back)."""
    core = EngineCore(engine)
    steps = [0]
    core.on_step.append(lambda deltas, dt: steps.__setitem__(0, steps[0] + 1))
    core.start()
    try:
        busy = [core.submit(prompt_token_ids=[1, 2, 3], params=SamplingParams(
            temperature=0.0, max_tokens=120, ignore_eos=True)) for _ in range(3)]
        while steps[0] < 3:
            time.sleep(0.001)
        waited, streams = [], []
        for _ in range(20):
            before = steps[0]
            stream = core.submit(prompt_token_ids=[4, 5],
                                 params=SamplingParams(temperature=0.0, max_tokens=1))
            waited.append(steps[0] - before)
            streams.append(stream)
            time.sleep(0.01)  # arrive while a step runs
        # on_step runs after the lock is handed over: one step may complete meanwhile.
        print("WAITED", waited)
        assert max(waited) <= 2, waited
        for s in busy + streams:
            s.abort()
    finally:
        core.shutdown()
