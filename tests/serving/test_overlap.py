"""The overlapped loop (async_scheduling) gives exactly the synchronous loop's outputs.

With overlap, step N+1 is dispatched before step N's tokens reach the host (they are
fed on the device), so every stop is seen one step late and a freed slot can be handed
to a new sequence while the old one's last step is still queued. The reference is the
same engine settings with async_scheduling=False: one step at a time.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from serving.engine.llm_engine import LLMEngine
from serving.engine.outputs import RequestOutput
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams
from tests.serving.conftest import SERVER_CFG

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU: outside the quick subset (-m "not slow")


@pytest.fixture(scope="module")
def engines(server_engine: LLMEngine) -> tuple[LLMEngine, LLMEngine]:
    assert server_engine.config.async_scheduling
    sync = LLMEngine("native-tiny", dataclasses.replace(SERVER_CFG, async_scheduling=False),
                     show_progress=False)
    return server_engine, sync


def _workload(engine: LLMEngine) -> tuple[list[list[int]], list[SamplingParams]]:
    """Mixed requests whose stops fire mid-run: stop ids and strings taken from a free run."""
    rng = np.random.default_rng(7)
    llm = LLM.from_engine(engine)
    prompts = [rng.integers(3, 259, int(rng.integers(2, 40))).tolist() for _ in range(14)]
    free = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        kind = i % 7
        if kind == 0:  # stop id, hit early
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop_token_ids=[out.token_ids[3]]))
        elif kind == 1:  # stop string cut from the middle of the free text
            params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True,
                                         stop=[out.text[4:6]] if len(out.text) > 6 else []))
        elif kind == 2:  # max_tokens 1 and 2: finished before / right after the next dispatch
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i % 2, ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=12,
                                         ignore_eos=True))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                         repetition_penalty=1.4, frequency_penalty=0.4,
                                         logit_bias={out.token_ids[2]: -100.0, 17: 2.5}))
        elif kind == 5:
            params.append(SamplingParams(temperature=0.0, max_tokens=9, logprobs=2, ignore_eos=True,
                                         min_tokens=5, stop_token_ids=[out.token_ids[1]]))
        else:  # EOS allowed (the tiny model may or may not emit it)
            params.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=14))
    return prompts, params


def _drive(engine: LLMEngine, prompts, params, *, abort_at: dict[int, str] | None = None,
           bad_at: int | None = None) -> dict[str, RequestOutput]:
    outs: dict[str, RequestOutput] = {}
    for i, (pr, p) in enumerate(zip(prompts, params, strict=True)):
        rid = engine.add_request(prompt_token_ids=pr, params=p, request_id=f"q{i}")
        outs[rid] = RequestOutput(rid, None, pr)
    step = 0
    while engine.has_unfinished():
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
        if step == bad_at:
            with pytest.raises(ValueError, match="prompt_token_ids"):
                engine.add_request(prompt_token_ids=[1, 10**7], params=SamplingParams())
        for d in engine.step():
            outs[d.request_id].add(d)
        step += 1
    for _ in range(2):  # let an in-flight step resolve (its samples are discarded)
        assert engine.step() == []
    s = engine.stats()
    assert s["slots_in_use"] == 0 and sum(s["pages_in_use"].values()) == 0
    return outs


def _same(a: RequestOutput, b: RequestOutput) -> bool:
    """Tokens, text and finish reason exactly; logprobs to 1e-4 relative (a step's batch
    composition, and so its padding bucket, differs between the loops: sums round apart)."""
    if (a.token_ids, a.text, a.finish_reason) != (b.token_ids, b.text, b.finish_reason):
        return False
    if (a.logprobs is None) != (b.logprobs is None):
        return False
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        if x.keys() != y.keys() or not all(np.isclose(x[k], y[k], rtol=1e-4, atol=1e-5) for k in x):
            return False
    return True


def test_overlapped_loop_equals_the_synchronous_loop(engines):
    fast, sync = engines
    prompts, params = _workload(sync)
    expect = _drive(sync, prompts, params)
    got = _drive(fast, prompts, params)
    assert got.keys() == expect.keys()
    assert [r for r in got if not _same(got[r], expect[r])] == []
    reasons = {o.finish_reason for o in got.values()}
    assert {"stop", "length"} <= reasons


def test_aborts_and_bad_requests_mid_run_harm_no_one(engines):
    fast, sync = engines
    prompts, params = _workload(sync)
    clean = _drive(sync, prompts, params)
    for engine in (fast, sync):
        got = _drive(engine, prompts, params, abort_at={3: "q3", 5: "q10", 6: "q0"}, bad_at=4)
        for rid, o in got.items():
            if rid in ("q3", "q10", "q0"):  # aborted (LLMEngine.abort emits no delta): a prefix
                n = len(o.token_ids)
                assert o.token_ids == clean[rid].token_ids[:n], rid
            else:
                assert _same(o, clean[rid]), rid


def test_a_slot_reused_at_once_never_sees_the_old_state(engines):
    """Short requests through max_num_seqs=4 slots: each equals its solo run."""
    fast, _ = engines
    llm = LLM.from_engine(fast)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 259, int(rng.integers(1, 30))).tolist() for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=1 + i % 3, ignore_eos=True,
                             presence_penalty=0.5 * (i % 2)) for i in range(12)]
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for pr, p, out in zip(prompts, params, batch, strict=True):
        assert out.token_ids == llm.generate(prompt_token_ids=[pr], sampling_params=p)[0].token_ids


def test_decode_steps_over_columns_equal_the_general_path(engines, monkeypatch):
    """The mixed workload with pure decode steps planned as columns (serving/core/decode_block.py)
    and with every step on the general path: the same outputs."""
    fast, _ = engines
    prompts, params = _workload(fast)
    planned = fast.scheduler._decode_block
    kinds: list[bool] = []

    def counted():
        block = planned()
        kinds.append(block is not None)
        return block

    monkeypatch.setattr(fast.scheduler, "_decode_block", counted)
    got = _drive(fast, prompts, params)
    monkeypatch.setattr(fast.scheduler, "_decode_block", lambda: None)
    expect = _drive(fast, prompts, params)
    assert sum(kinds) >= 10, kinds  # the column path ran
    assert got.keys() == expect.keys()
    assert [r for r in got if not _same(got[r], expect[r])] == []
