"""Multi-step decoding (num_scheduler_steps) gives exactly the one-step-per-call outputs.

A multi-step call runs q decode steps on the device and returns q tokens per sequence;
the host keeps each sequence's tokens up to its stop. References: the full-sequence
forward recomputed for every token (`greedy_generate`: no pages, slots or loop) for
greedy tokens, and the same engine settings without multi-step (the synchronous loop)
for mixed workloads with stops, sampling, penalties and logprobs.
"""

from __future__ import annotations

import dataclasses

import pytest

from hybrid_jax.generate import greedy_generate
from serving.engine import LLMEngine
from serving.engine_config import EngineConfig
from serving.sampling_params import SamplingParams
from tests.serving.conftest import SERVER_CFG
from tests.serving.test_engine_parity import native_hybrid
from tests.serving.test_overlap import _drive, _same, _workload
from tests.serving.test_speculative import prompts_for, staggered

pytestmark = pytest.mark.slow  # compiles two engines on CPU


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    multi = LLMEngine("native-tiny", dataclasses.replace(SERVER_CFG, num_scheduler_steps=4),
                      show_progress=False)
    sync = LLMEngine("native-tiny", dataclasses.replace(SERVER_CFG, async_scheduling=False),
                     show_progress=False)
    return multi, sync


def test_mixed_workload_equals_the_one_step_loop(engines):
    """Stop ids and strings inside a run, max_tokens 1-2 and mid-run, seeded sampling with
    and without top-p, EOS; penalty and top-n-logprob rows (not multi-step) in between."""
    multi, sync = engines
    prompts, params = _workload(sync)
    expect = _drive(sync, prompts, params)
    calls = multi.stats()["multi_step_calls"]
    got = _drive(multi, prompts, params)
    assert [r for r in got if not _same(got[r], expect[r])] == []
    assert multi.stats()["multi_step_calls"] > calls


def test_eligible_only_workload_logprobs_and_aborts(engines):
    """Every row multi-step eligible (the sampled token's logprob kept); requests aborted
    between calls leave a prefix of their tokens and harm no one."""
    multi, sync = engines
    prompts, params = _workload(sync)
    keep = [i for i, p in enumerate(params) if not p.logprobs and p.repetition_penalty == 1.0
            and p.frequency_penalty == 0.0]
    prompts = [prompts[i] for i in keep]
    params = [dataclasses.replace(params[i], logprobs=0 if j % 2 else None)
              for j, i in enumerate(keep)]
    expect = _drive(sync, prompts, params)
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


def test_greedy_equals_the_full_forward_with_arrivals():
    """Native hybrid (SWA, Mamba2, parallel layers), q = 5 > the window's page: sequences
    join while others multi-step, max_tokens cut inside a run."""
    lm = native_hybrid()
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7,
                       max_model_len=64, page_size=8, seq_buckets=(4,), token_buckets=(32,),
                       num_scheduler_steps=5)
    eng = LLMEngine(lm, cfg, show_progress=False)
    prompts = prompts_for(lm.config.vocab_size, seed=5, lens=(30, 5, 19))
    params = SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True)
    refs = [greedy_generate(lm.model, p, 13) for p in prompts]
    assert staggered(eng, prompts, params) == refs
    assert eng.stats()["multi_step_calls"] > 0
    s = eng.stats()
    assert s["slots_in_use"] == 0 and sum(s["pages_in_use"].values()) == 0


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
