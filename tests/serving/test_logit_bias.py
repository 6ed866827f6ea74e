"""logit_bias: each slot's bias row on the device, added to the logits before the penalties
and sampling; checked against numpy, the model's own top-2, and the same requests unbiased."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.loading import load_model
from serving.entrypoints.llm import LLM
from serving.sample.penalties import apply_logit_bias, bias_row, init_token_stats, set_logit_bias
from serving.sample.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from tests.serving.test_speculative import prompts_for, spec_engine


def test_bias_rows_add_to_their_slots_rows_only():
    stats = init_token_stats(4, 10)
    stats = set_logit_bias(stats, 2, *bias_row(((1, 2.5), (7, -100.0))))
    stats = set_logit_bias(stats, 3, *bias_row(((0, 1.0),)))
    stats = set_logit_bias(stats, 3, *bias_row(((9, -1.5),)))  # a row replaced, not merged
    logits = np.random.default_rng(0).normal(size=(3, 10)).astype(np.float32)
    got = np.asarray(apply_logit_bias(jnp.asarray(logits), stats, jnp.asarray([2, 1, 3])))
    want = logits.copy()
    want[0, 1] += 2.5
    want[0, 7] -= 100.0
    want[2, 9] -= 1.5
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_params_take_a_dict_or_pairs_and_name_the_field():
    assert SamplingParams(logit_bias={5: 1, 2: -100}).logit_bias == ((2, -100.0), (5, 1.0))
    assert SamplingParams(logit_bias=[(3, 0.5)]) == SamplingParams(logit_bias={3: 0.5})
    assert SamplingParams(logit_bias=None).logit_bias == ()
    for bad in ({-1: 1.0}, {1: 100.5}, {1: float("inf")}, {"a": 1.0}, 7, [(1, 1.0), (1, 2.0)],
                {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.fixture(scope="module")
def llm():
    return LLM("native-tiny", max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=32,
               max_model_len=128, show_progress=False)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)


def test_bias_moves_greedy_to_the_models_second_choice_and_spares_other_rows(llm):
    prompts = [[3, 9, 27, 5, 7], [11, 4, 8, 2, 6, 1, 3], [40, 41, 42]]
    base = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(logprobs=2))
    first = base[0].token_ids[0]
    second = max((t for t in base[0].logprobs[0] if t != first), key=base[0].logprobs[0].get)
    mixed = llm.generate(prompt_token_ids=prompts, sampling_params=[
        _greedy(logit_bias={first: -100.0}), _greedy(), _greedy(logit_bias={77: 100.0})])
    assert mixed[0].token_ids[0] == second and first not in mixed[0].token_ids
    assert mixed[1].token_ids == base[1].token_ids  # an unbiased row of the same steps
    assert mixed[2].token_ids == [77] * 6
    # the slots the biased requests used serve unbiased requests as before (rows reset)
    again = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(logprobs=2))
    assert [o.token_ids for o in again] == [o.token_ids for o in base]
    # a small bias equals adding it to the logits: the logprobs stay the model's raw ones
    nudged = llm.generate(prompt_token_ids=prompts[:1], sampling_params=_greedy(
        logprobs=2, logit_bias={second: base[0].logprobs[0][first] - base[0].logprobs[0][second] + 1.0}))
    assert nudged[0].token_ids[0] == second
    assert nudged[0].logprobs[0][second] == pytest.approx(base[0].logprobs[0][second], abs=1e-5)


def test_speculation_leaves_biased_output_unchanged(llm):
    """A biased row is never verified (its bias lives in the full sampler only); the
    others speculate beside it, and every output equals the plain engine's."""
    eng = spec_engine(load_model("native-tiny"), 3)
    prompts = prompts_for(259, 0)  # as the speculative tests' (the tiny model repeats itself)
    long = dict(max_tokens=20)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, logit_bias={6: -100.0}, **long),
              SamplingParams(temperature=0.0, ignore_eos=True, **long),
              SamplingParams(temperature=0.0, ignore_eos=True, **long)]
    want = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    got = [o.token_ids for o in LLM.from_engine(eng).generate(prompt_token_ids=prompts,
                                                              sampling_params=params)]
    assert got == want and 6 not in got[0]
    assert eng.spec_counters.verify_steps > 0
