"""On-device sampling: greedy, filters, seeded reproducibility independent of the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.sample.sampling import SamplingArrays, filter_logits, sample

sample_jit = jax.jit(sample)


def rows(n, **kw):
    return SamplingArrays.from_rows([dict(kw) for _ in range(n)])


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    logits = jax.random.normal(jax.random.key(0), (5, 50))
    tok, lp = sample_jit(logits, rows(5, temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(logits.argmax(-1)))
    want = np.asarray(jax.nn.log_softmax(logits))[np.arange(5), np.asarray(tok)]
    np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-6)


def test_filters_keep_exactly_the_expected_sets():
    logits = jnp.log(jnp.asarray([[0.5, 0.2, 0.15, 0.1, 0.05]] * 3))
    p = SamplingArrays.from_rows([{"top_k": 2}, {"top_p": 0.8}, {"min_p": 0.25}])
    kept = np.isfinite(np.asarray(filter_logits(logits, p)))
    np.testing.assert_array_equal(kept, [[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]])


def test_seeded_draws_do_not_depend_on_batch_position_or_neighbours():
    logits = jax.random.normal(jax.random.key(1), (4, 100)) * 3
    a = SamplingArrays.from_rows([{"temperature": 1.0, "seed": s, "step": 3} for s in (7, 8, 9, 10)])
    tok_a, _ = sample_jit(logits, a)
    # Same request (seed 9, row 2 logits) alone, and moved to row 0 with other neighbours.
    alone = SamplingArrays.from_rows([{"temperature": 1.0, "seed": 9, "step": 3}])
    tok_alone, _ = sample_jit(logits[2:3], alone)
    moved = SamplingArrays.from_rows([{"temperature": 1.0, "seed": 9, "step": 3},
                                      {"temperature": 0.5, "seed": 1, "step": 0}])
    tok_moved, _ = sample_jit(jnp.stack([logits[2], logits[0]]), moved)
    assert int(tok_a[2]) == int(tok_alone[0]) == int(tok_moved[0])


def test_sampling_follows_the_distribution():
    probs = np.asarray([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs)), (n, 4))
    p = SamplingArrays.from_rows([{"temperature": 1.0, "seed": 3, "step": i} for i in range(n)])
    tok, _ = sample_jit(logits, p)
    freq = np.bincount(np.asarray(tok), minlength=4) / n
    np.testing.assert_allclose(freq, probs, atol=0.03)
    # top_k=2 renormalises over the two most likely tokens.
    p2 = p._replace(top_k=jnp.full((n,), 2, jnp.int32))
    freq2 = np.bincount(np.asarray(sample_jit(logits, p2)[0]), minlength=4) / n
    np.testing.assert_allclose(freq2, [0.625, 0.375, 0, 0], atol=0.03)


def test_suppressed_ids_are_never_sampled():
    logits = jnp.zeros((2, 6)).at[:, 3].set(10.0)
    p = SamplingArrays.from_rows([{"suppress": [3]}, {"temperature": 1.0, "suppress": [3, 0]}])
    tok, _ = sample_jit(logits, p)
    assert 3 not in np.asarray(tok).tolist() and int(tok[1]) != 0
