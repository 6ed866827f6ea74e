"""Penalties against an independent numpy reference, in the engine and as device functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.penalties import apply_penalties, init_token_stats, update_token_stats
from serving.sample.sampling_params import SamplingParams


def penalise_np(logits, prompt, output, rep, pres, freq):
    out = logits.astype(np.float64).copy()
    seen = set(prompt) | set(output)
    for tok in seen:
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(output):
        out[tok] -= freq * output.count(tok) + pres
    return out


def test_device_statistics_follow_prompts_outputs_and_first_chunks():
    v = 12
    stats = init_token_stats(4, v)
    stats = stats._replace(counts=stats.counts.at[2].set(7), seen=stats.seen.at[2].set(True))
    # Two sequences: slot 1 continues (prompt_len 2, positions 2..3 are outputs), slot 2 starts
    # anew (its stale row must be cleared); one padding token at the end.
    tokens = jnp.asarray([5, 5, 3, 4, 4, 0], jnp.int32)
    positions = jnp.asarray([2, 3, 0, 1, 2, 0], jnp.int32)
    cu = jnp.asarray([0, 2, 5], jnp.int32)
    stats = update_token_stats(stats, tokens, positions, cu, jnp.asarray([1, 2], jnp.int32),
                               jnp.asarray([True, False]), jnp.asarray([2, 1], jnp.int32))
    counts, seen = np.asarray(stats.counts), np.asarray(stats.seen)
    assert counts[1, 5] == 2 and counts[1].sum() == 2
    assert counts[2, 4] == 2 and counts[2].sum() == 2 and not counts[2, 3]
    assert seen[2].nonzero()[0].tolist() == [3, 4]
    logits = np.random.default_rng(0).normal(size=(2, v)).astype(np.float32)
    got = apply_penalties(jnp.asarray(logits), stats, jnp.asarray([1, 2], jnp.int32),
                          jnp.asarray([1.5, 2.0]), jnp.asarray([0.1, 0.2]), jnp.asarray([0.3, 0.4]))
    want0 = penalise_np(logits[0], [], [5, 5], 1.5, 0.1, 0.3)
    want1 = penalise_np(logits[1], [3], [4, 4], 2.0, 0.2, 0.4)
    np.testing.assert_allclose(np.asarray(got), np.stack([want0, want1]), rtol=1e-6, atol=1e-6)


def test_decode_statistics_skip_the_reset_and_equal_the_general_update():
    """`continues=True` (decode executables: every real row has_initial) leaves rows as the
    general update does when no row starts anew; the general update zeroes only the rows
    of first chunks (slot 3's stale row, untouched by this step, stays)."""
    rng = np.random.default_rng(4)
    stats = init_token_stats(5, 9)
    stats = stats._replace(counts=jnp.asarray(rng.integers(0, 3, (5, 9)), jnp.int32),
                           seen=jnp.asarray(rng.random((5, 9)) < 0.5))
    tokens, positions = jnp.asarray([4, 7, 0], jnp.int32), jnp.asarray([6, 3, 0], jnp.int32)
    cu, slots = jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray([1, 2, 0], jnp.int32)
    args = (tokens, positions, cu, slots, jnp.asarray([True, True, False]), jnp.asarray([2, 3, 0], jnp.int32))
    got = update_token_stats(stats, *args, continues=True)
    want = update_token_stats(stats, *args)
    for g, w, old in zip(got, want, stats, strict=True):
        np.testing.assert_array_equal(np.asarray(g)[1:], np.asarray(w)[1:])  # slot 0: the dummy
        np.testing.assert_array_equal(np.asarray(g)[3:], np.asarray(old)[3:])
    assert int(got.counts[1, 4]) == int(stats.counts[1, 4]) + 1  # position 6 >= prompt 2: output
    assert int(got.counts[2, 7]) == int(stats.counts[2, 7]) + 1  # position 3 = prompt length 3: output
    fresh = update_token_stats(stats, *args[:4], jnp.asarray([False, True, False]), args[5])
    assert np.asarray(fresh.counts[1]).tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(fresh.counts[3]), np.asarray(stats.counts[3]))


@pytest.fixture(scope="module")
def served():
    lm = load_model("native-tiny")
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                        max_prefill_chunk=16, max_model_len=96, page_size=8),
                       show_progress=False)
    return lm, LLM.from_engine(engine)


@pytest.mark.parametrize("penalties", [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=1.0, presence_penalty=0.5),
])
def test_engine_penalties_match_full_forward_reference(served, penalties):
    lm, llm = served
    prompt = [10, 11, 12, 10, 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **penalties)
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids
    # The full forward over a right-padded sequence (every mixer is causal: position i sees
    # tokens <= i), jitted once: the eager forward compiled ~1,200 ops (50 s of CI).
    ids = np.zeros((1, len(prompt) + 12), np.int32)
    ids[0, :len(prompt)] = prompt
    fwd = jax.jit(lambda x, i: jax.lax.dynamic_index_in_dim(lm.model(x)[0], i, keepdims=False))
    output: list[int] = []
    for _ in range(12):
        logits = np.asarray(fwd(jnp.asarray(ids), len(prompt) + len(output) - 1))
        out = penalise_np(logits, prompt, output, params.repetition_penalty,
                          params.presence_penalty, params.frequency_penalty)
        output.append(int(np.argmax(out)))
        ids[0, len(prompt) + len(output) - 1] = output[-1]
    assert got == output
    plain = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))[0].token_ids
    assert plain != got  # the penalties changed something
