"""Fault isolation: one bad request (or one failing step) harms nobody else.

The fault is injected by wrapping the runner (a test hook, not production code): every
step that contains the poisoned request's slot raises, as a step would whose inputs
for that request break the host-side preparation or the kernels. The reference run
is the same engine serving the same requests without the fault.
"""

from __future__ import annotations

import time

import pytest

from serving.engine.engine_core import EngineCore, EngineStopped
from serving.engine.faults import EngineFatal
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(server_engine: LLMEngine) -> LLMEngine:
    return server_engine


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.0, max_tokens=6 + i % 5, ignore_eos=True)
    return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=5 + i % 4, ignore_eos=True)


PROMPTS = [[5 + i, 40 + 3 * i, 7, 90 + i] * (1 + i % 3) for i in range(7)]


def _run(engine: LLMEngine, poison: str | None = None) -> dict[str, tuple[list[int], str]]:
    run = engine.runner.dispatch

    def faulty(arrays, *args, **kwargs):
        seq = engine.scheduler.get(poison) if poison else None
        if seq is not None and seq.slot in arrays.slot_ids.tolist():
            raise RuntimeError("injected fault")
        return run(arrays, *args, **kwargs)

    engine.runner.dispatch = faulty
    try:
        ids = [engine.add_request(prompt_token_ids=p, params=_params(i), request_id=f"r{i}")
               for i, p in enumerate(PROMPTS)]
        out: dict[str, tuple[list[int], str]] = {r: ([], "") for r in ids}
        for _ in range(500):
            if not engine.has_unfinished():
                break
            for d in engine.step():
                toks, _ = out[d.request_id]
                out[d.request_id] = (toks + d.token_ids, d.finish_reason or "")
        return out
    finally:
        engine.runner.dispatch = run


def _baseline(engine: LLMEngine) -> tuple[int, int]:
    s = engine.stats()
    return sum(s["pages_in_use"].values()), s["slots_in_use"]


def test_a_faulty_request_fails_alone_and_the_others_are_unchanged(engine):
    clean = _run(engine)
    assert all(reason == "length" for _, reason in clean.values())
    faulty = _run(engine, poison="r3")
    assert faulty["r3"][1] == "error"
    for rid, (tokens, reason) in clean.items():
        if rid != "r3":
            assert faulty[rid] == (tokens, reason), rid
    assert _baseline(engine) == (0, 0)
    assert engine.scheduler.held == set()
    # The engine serves the next request as if nothing had happened.
    again = LLM.from_engine(engine).generate(prompt_token_ids=[PROMPTS[1]], sampling_params=_params(1))
    assert again[0].token_ids == clean["r1"][0]


def test_any_int64_seed_is_a_reproducible_sampling_seed(engine):
    llm = LLM.from_engine(engine)
    p = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    neg = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(seed=-1, **p))
    wrap = llm.generate(prompt_token_ids=[[3, 4, 5]],
                        sampling_params=SamplingParams(seed=2**32 - 1, **p))
    big = llm.generate(prompt_token_ids=[[3, 4, 5]], sampling_params=SamplingParams(seed=-2**63, **p))
    assert neg[0].token_ids == wrap[0].token_ids and len(neg[0].token_ids) == 8
    assert big[0].finish_reason == "length"
    assert _baseline(engine) == (0, 0)


def test_lost_device_state_is_fatal_and_the_core_says_so(engine, monkeypatch):
    core = EngineCore(engine)
    fatal: list[BaseException] = []
    core.on_fatal.append(fatal.append)
    monkeypatch.setattr(engine.runner, "dispatch", lambda *a: (_ for _ in ()).throw(RuntimeError("gone")))
    monkeypatch.setattr(engine.runner, "state_lost", lambda: True)
    core.start()
    stream = core.submit(prompt_token_ids=[1, 2, 3], params=_params(1))
    with pytest.raises(EngineStopped):
        stream.get(timeout=30)
    deadline = time.monotonic() + 10
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not core.healthy and isinstance(fatal[0], EngineFatal)
    with pytest.raises(EngineStopped):
        core.submit(prompt_token_ids=[1, 2], params=_params(1))
    core.shutdown()
    assert _baseline(engine) == (0, 0) and not engine.has_unfinished()


def test_every_step_failing_is_fatal_after_a_bound(engine, monkeypatch):
    """A broken device fails every step: after max_consecutive failures in a row, give up."""
    monkeypatch.setattr(engine.runner, "dispatch", lambda *a: (_ for _ in ()).throw(RuntimeError("x")))
    n = engine._faults.max_consecutive + 2
    for i in range(n):
        engine.add_request(prompt_token_ids=[1, 2, 3 + i], params=_params(1), request_id=f"f{i}")
    errors = []
    with pytest.raises(EngineFatal):
        for _ in range(50):
            errors += [d.request_id for d in engine.step() if d.finish_reason == "error"]
    assert 0 < len(errors) < n
    for i in range(n):
        engine.abort(f"f{i}")
    assert _baseline(engine) == (0, 0) and not engine.has_unfinished()
    engine._faults.consecutive = 0
