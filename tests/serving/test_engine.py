"""Engine behaviour on the native preset: batch == solo, slot reuse, preemption, no recompiles.

One engine is shared by the module (compilation dominates on CPU). Requests mix greedy
and seeded sampling with random prompt and output lengths.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from jax import monitoring

from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU: outside the quick subset (-m "not slow")

COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda name, *_a, **_k: COMPILES.append(name) if "backend_compile" in name else None)

ENGINE = dict(max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=16,
              max_model_len=160, page_size=8, show_progress=False)


def requests(n: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append(rng.integers(3, 259, int(rng.integers(1, 90))).tolist())
        max_tokens = int(rng.integers(1, 24))
        if i % 3 == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        elif i % 3 == 2:  # greedy with penalties: per-slot statistics must follow the request
            bias = {(7 * i) % 256 + 3: -100.0, 50: 4.0} if i % 6 == 5 else None  # so must the bias
            params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                         repetition_penalty=1.3, frequency_penalty=0.5,
                                         presence_penalty=0.3, logit_bias=bias))
        else:
            params.append(SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=1000 + i,
                                         max_tokens=max_tokens, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("native-tiny", **ENGINE)


def solo(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    return llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids


def test_ragged_batch_equals_solo_runs_and_never_recompiles(llm):
    prompts, params = requests(40, seed=0)
    before = len(COMPILES)
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        assert out.token_ids == solo(llm, prompt, p)
        assert len(out.token_ids) == p.max_tokens and out.finish_reason == "length"
    assert len(COMPILES) == before, "the engine compiled during serving"
    stats = llm.engine.stats()
    assert stats["slots_in_use"] == 0 and sum(stats["pages_in_use"].values()) == 0
    assert stats["kv_bytes"] > 0 and stats["state_bytes"] > 0


def test_slot_reuse_leaks_nothing(llm):
    prompts, params = requests(3, seed=1)
    first = [solo(llm, pr, p) for pr, p in zip(prompts, params, strict=True)]
    filler, fparams = requests(100, seed=2)
    llm.generate(prompt_token_ids=filler, sampling_params=fparams)
    again = [solo(llm, pr, p) for pr, p in zip(prompts, params, strict=True)]
    assert again == first


def test_preemption_by_recompute_keeps_outputs_identical():
    small = LLM("native-tiny", **(ENGINE | {"num_pages": 16}))
    prompts, params = requests(12, seed=3)
    params = [dataclasses.replace(p, max_tokens=24) for p in params]
    batch = small.generate(prompt_token_ids=prompts, sampling_params=params)
    assert small.engine.stats()["num_preemptions"] > 0
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        assert out.token_ids == solo(small, prompt, p)


def test_stop_conditions_and_finish_reasons(llm):
    prompt = [5, 6, 7]
    free = solo(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop_tok = free[4]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], ignore_eos=True))[0]
    assert out.token_ids == free[:free.index(stop_tok) + 1] and out.finish_reason == "stop"
    # min_tokens suppresses the stop id until enough tokens exist.
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, min_tokens=8, stop_token_ids=[stop_tok],
        ignore_eos=True))[0]
    assert stop_tok not in out.token_ids[:8] and len(out.token_ids) >= 8
    # A stop string ends generation and is cut from the text.
    text = llm.engine.tokenizer.decode(free)
    target = text[3:5]
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, stop=[target], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and out.text == text[:text.find(target)]


def test_logprobs_and_stream(llm):
    p = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    out = llm.generate(prompt_token_ids=[[9, 10, 11]], sampling_params=p)[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert tok in lp and lp[tok] == max(lp.values()) and len(lp) == 3
    deltas = list(llm.stream(prompt_token_ids=[9, 10, 11], sampling_params=p))
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("kwargs,field", [
    ({"prompt_token_ids": [[]]}, "prompt_token_ids"),
    ({"prompt_token_ids": [[1, 99999]]}, "prompt_token_ids"),
    ({"prompt_token_ids": [[1] * 150], "sampling_params": SamplingParams(max_tokens=20)},
     "max_model_len"),
    ({"prompt_token_ids": [[1]], "sampling_params": SamplingParams(stop_token_ids=[10**6])},
     "stop_token_ids"),
])
def test_bad_requests_are_named_and_harm_nothing(llm, kwargs, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(**kwargs)
    assert llm.engine.stats()["slots_in_use"] == 0 and not llm.engine.has_unfinished()
    assert len(solo(llm, [4, 5], SamplingParams(temperature=0.0, max_tokens=2))) == 2


def test_swa_pages_stay_within_the_window_bound_while_decoding(llm):
    """native-tiny: window 64, page 8 -> at most ceil(63/8)+1 = 9 pages between steps."""
    engine = llm.engine
    engine.add_request(prompt_token_ids=list(range(3, 43)), params=SamplingParams(
        temperature=0.0, max_tokens=110, ignore_eos=True))
    peak = 0
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, *engine.stats()["pages_in_use"].values())
    assert 0 < peak <= 9


def test_runner_refuses_out_of_range_indices(llm):
    """JAX would clamp these silently on device; the runner checks them on the host."""
    from serving.core.schedule import StepArrays

    runner = llm.engine.runner
    i32 = lambda *v: np.asarray(v, np.int32)
    bad = StepArrays(token_ids=i32(1), positions=i32(0), cu_seqlens=i32(0, 1), query_lens=i32(1),
                     seq_lens=i32(1), slot_ids=i32(runner.num_slots), has_initial=np.zeros(1, bool),
                     page_tables=(np.zeros((1, runner.ring_widths[0]), np.int32),),
                     slot_mappings=(i32(0),), sample_mask=np.ones(1, bool), logits_indices=i32(0),
                     num_decodes=0)
    with pytest.raises(AssertionError, match="slot_ids"):
        runner._pad(bad, runner.pick(bad))


def test_extreme_sampling_values_run_as_their_limits(llm):
    """top_k beyond the vocabulary keeps every token (= top_k off); a temperature beyond
    float32's range samples like an infinite one; neither warns or breaks the step."""
    import warnings

    prompt = [5, 6, 7]
    base = dict(temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        huge_k = solo(llm, prompt, SamplingParams(top_k=2**40, **base))
        hot = solo(llm, prompt, SamplingParams(**{**base, "temperature": 1e39}))
    assert huge_k == solo(llm, prompt, SamplingParams(top_k=-1, **base))
    assert len(hot) == 6 and all(0 <= t < llm.engine.model_config.vocab_size for t in hot)
