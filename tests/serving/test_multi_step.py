"""Multi-step decoding (num_scheduler_steps) gives exactly the one-step-per-call outputs.

A multi-step call runs q decode steps on the device and returns q tokens per sequence;
the host keeps each sequence's tokens up to its stop. References: the full-sequence
forward recomputed for every token (`greedy_generate`: no pages, slots or loop) for
greedy tokens, and the same engine settings without multi-step (one step per call) for
mixed workloads with stops, sampling, penalties and logprobs.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_jax.generate import greedy_generate
from serving.core.scheduler import Scheduler, SpecPlan
from serving.core.scheduler_config import SchedulerConfig
from serving.core.sequence import Sequence
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams
from tests.serving.conftest import SERVER_CFG
from tests.serving.test_engine_parity import native_hybrid
from tests.serving.test_overlap import _drive, _same, _workload
from tests.serving.test_speculative import prompts_for, staggered

pytestmark = pytest.mark.slow  # compiles two engines on CPU


@pytest.fixture(scope="module")
def engines(server_engine: LLMEngine) -> tuple[LLMEngine, LLMEngine]:
    """The multi-step engine and the plain one (the overlapped loop, which equals the
    synchronous loop: tests/serving/test_overlap.py) with the same settings."""
    multi = LLMEngine("native-tiny", dataclasses.replace(SERVER_CFG, num_scheduler_steps=4),
                      show_progress=False)
    return multi, server_engine


def test_mixed_workload_equals_the_one_step_loop(engines):
    """Stop ids and strings inside a run, max_tokens 1-2 and mid-run, seeded sampling with
    and without top-p, EOS; penalty and top-n-logprob rows (not multi-step) in between."""
    multi, plain = engines
    prompts, params = _workload(plain)
    expect = _drive(plain, prompts, params)
    calls = multi.stats()["multi_step_calls"]
    got = _drive(multi, prompts, params)
    assert [r for r in got if not _same(got[r], expect[r])] == []
    assert multi.stats()["multi_step_calls"] > calls


def test_eligible_only_workload_logprobs_and_aborts(engines):
    """Every row multi-step eligible (the sampled token's logprob kept); requests aborted
    between calls leave a prefix of their tokens and harm no one."""
    multi, plain = engines
    prompts, params = _workload(plain)
    keep = [i for i, p in enumerate(params) if not p.logprobs and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0]
    prompts = [prompts[i] for i in keep]
    params = [dataclasses.replace(params[i], logprobs=0 if j % 2 else None)
              for j, i in enumerate(keep)]
    expect = _drive(plain, prompts, params)
    calls = multi.stats()["multi_step_calls"]
    got = _drive(multi, prompts, params)
    assert [r for r in got if not _same(got[r], expect[r])] == []
    assert multi.stats()["multi_step_calls"] - calls >= 3
    assert all(len(o.logprobs) == len(o.token_ids) for o in got.values() if o.logprobs is not None)
    aborted = _drive(multi, prompts, params, abort_at={2: "q1", 4: "q3"})
    for rid, o in aborted.items():
        if rid in ("q1", "q3"):
            assert o.token_ids == expect[rid].token_ids[:len(o.token_ids)], rid
        else:
            assert _same(o, expect[rid]), rid


@pytest.fixture(scope="module")
def hybrid_engines() -> tuple[LLMEngine, LLMEngine]:
    """The native hybrid (SWA, Mamba2, parallel layers; random weights: flat logits, so
    sampled tokens depend on every key) with q = 5 > a page, and without multi-step."""
    lm = native_hybrid()
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7,
                       max_model_len=64, page_size=8, seq_buckets=(4,), token_buckets=(32,))
    return (LLMEngine(lm, dataclasses.replace(cfg, num_scheduler_steps=5), show_progress=False),
            LLMEngine(lm, cfg, show_progress=False))


def test_greedy_equals_the_full_forward_with_arrivals(hybrid_engines):
    """Sequences join while others multi-step; max_tokens cut inside a run."""
    eng = hybrid_engines[0]
    lm = native_hybrid()  # the same weights (Rngs(0))
    prompts = prompts_for(lm.config.vocab_size, seed=5, lens=(30, 5, 19))
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    refs = [greedy_generate(lm.model, p, 13) for p in prompts]
    calls = eng.stats()["multi_step_calls"]
    assert staggered(eng, prompts, params) == refs
    assert eng.stats()["multi_step_calls"] > calls
    s = eng.stats()
    assert s["slots_in_use"] == 0 and sum(s["pages_in_use"].values()) == 0


def test_sampled_rows_and_stop_ids_inside_runs(hybrid_engines):
    """Four requests decoding together from the start: seeded sampling with and without
    top-k / top-p / min-p (each token's key folds its own output index), a stop id that
    fires inside a run, the sampled tokens' logprobs."""
    multi, plain = hybrid_engines
    prompts = prompts_for(128, seed=9, lens=(6, 11, 3, 8))
    free = LLM.from_engine(plain).generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=24, ignore_eos=True))
    params = [SamplingParams(temperature=0.9, top_p=0.8, top_k=40, seed=1, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=23, ignore_eos=True, logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                             stop_token_ids=[free[2].token_ids[9]]),
              SamplingParams(temperature=0.7, min_p=0.05, seed=4, max_tokens=21, logprobs=0)]
    expect = _drive(plain, prompts, params)
    calls = multi.stats()["multi_step_calls"]
    got = _drive(multi, prompts, params)
    assert [r for r in got if not _same(got[r], expect[r])] == []
    assert multi.stats()["multi_step_calls"] - calls >= 3
    assert got["q2"].finish_reason == "stop" and len(got["q2"].token_ids) <= 10
    assert len(set(got["q1"].token_ids)) > 3  # sampled, not stuck on one token


@pytest.mark.parametrize("kw, field", [
    ({"num_scheduler_steps": 0}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 65}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 4, "multi_step_max_seqs": 0}, "multi_step_max_seqs"),
    ({"num_scheduler_steps": 9, "max_prefill_chunk": 8}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 4, "speculative_method": "ngram"}, "num_scheduler_steps"),
    ({"num_scheduler_steps": 4, "tensor_parallel_size": 2}, "num_scheduler_steps"),
])
def test_settings_that_cannot_work_are_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_verify_ready_looks_past_the_step_in_flight():
    """The engine waits for the step in flight only when a multi-step call would follow:
    `verify_ready` answers as if it were resolved, and says no when pages are short."""
    plan = SpecPlan(12, 2, lambda seq: True, lambda work: [[0] * n for _, n in work])
    for pages, fits in ((400, True), (7, False)):  # 7: two 6-token sequences leave 2 pages free
        sch = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_chunk=12,
                                        max_model_len=24, page_size=4, num_slots=3,
                                        groups=(("global", None, pages),)))
        for name in "ab":
            sch.add(Sequence(name, [1, 2, 3, 4, 5], SamplingParams(max_tokens=18)))
        prefill = sch.schedule()
        sch.update(prefill, [7, 7])
        decode = sch.schedule()  # in flight
        assert not sch._can_verify(plan)
        assert sch.verify_ready(plan) is fits
        sch.update(decode, [8, 8])
        assert sch._can_verify(plan) is fits
        assert sch.schedule(plan).is_verify is fits


def test_multi_step_executables_alias_their_results(engines):
    """The multi-step executables write their results into donated buffers (the runner
    reuses them call after call: serving/runner/result_buffers.py)."""
    from tests.serving.test_output_buffers import assert_results_aliased

    r = engines[0].runner
    assert r.multisteps
    for (bucket, _), exe in r.multisteps.items():
        assert_results_aliased(exe, r.caches, r.stats, r.results.sync_shapes("multi", bucket))
