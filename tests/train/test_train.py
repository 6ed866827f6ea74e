"""The train step and loop: loss goes down, resume is exact, gradients match finite differences."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrid_jax.checkpoints.native import load_native
from hybrid_jax.train.checkpoint import load_init_params
from hybrid_jax.train.dataset import prepare
from hybrid_jax.train.loop import train
from hybrid_jax.train.step import init_params, make_apply, make_steps, token_nats
from tests.train.helpers import tiny_model, tiny_train, write_corpus


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _setup(corpus_dir, run_dir, **kw):
    tc = tiny_train(**kw)
    data = prepare([str(corpus_dir)], tc, run_dir)
    return tiny_model(data.tokenizer.vocab_size), tc, data


def test_loss_decreases_and_the_run_exports_a_loadable_model(corpus_dir, tmp_path):
    cfg, tc, data = _setup(corpus_dir, tmp_path, steps=20, log_every=5, eval_every=20)
    res = train(cfg, tc, data, tmp_path, quiet=True)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if r["kind"] == "train"]
    assert losses[-1] < 0.6 * losses[0], losses
    assert res.eval["loss"] < np.log(cfg.vocab_size)  # better than uniform on held-out files
    assert res.eval["bits_per_byte"] > 0 and len(res.eval["loss_by_position"]) == tc.seq_len
    assert [r["kind"] for r in log][0] == "start" and log[-1]["kind"] == "end"
    model, _ = load_native(tmp_path / "model")
    tokens = jnp.asarray(data.train_rows[:2, :-1])
    ref = make_apply(cfg, "float32")(res.params, tokens)
    np.testing.assert_allclose(model(tokens), ref, rtol=1e-5, atol=1e-5)
    # --init-from: a new run starts from the exported parameters (f32 export: exactly);
    # its first step has lr 0 (warmup from 0), so after it the parameters are still those
    init = load_init_params(tmp_path / "model", cfg)
    _params_equal(init, res.params)
    first = train(cfg, tc, data, tmp_path / "next", quiet=True, export=False, stop_at=1, init=init)
    _params_equal(first.params, res.params)
    log = [json.loads(line) for line in (tmp_path / "next" / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["init_from"] is None and first.step == 1
    with pytest.raises(ValueError, match="init_from=.*vocab_size"):
        load_init_params(tmp_path / "model", dataclasses.replace(cfg, vocab_size=cfg.vocab_size + 1))
    with pytest.raises(ValueError, match="init_from=.*not a native model"):
        load_init_params(tmp_path, cfg)


def _params_equal(a, b) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_interrupted_and_resumed_equals_uninterrupted(corpus_dir, tmp_path):
    kw = dict(steps=6, ckpt_every=2, grad_accum=2)
    cfg, tc, data = _setup(corpus_dir, tmp_path / "a", **kw)
    straight = train(cfg, tc, data, tmp_path / "a", quiet=True, export=False)
    _, _, data_b = _setup(corpus_dir, tmp_path / "b", **kw)
    first = train(cfg, tc, data_b, tmp_path / "b", quiet=True, stop_at=3, export=False)
    assert first.step == 3
    # a new process would rebuild everything; the checkpoint holds step 3 (saved on stop)
    resumed = train(cfg, tc, data_b, tmp_path / "b", quiet=True, export=False)
    assert resumed.step == 6
    _params_equal(straight.params, resumed.params)
    with pytest.raises(AssertionError):  # and the comparison can fail: step 3 differs
        _params_equal(straight.params, first.params)


def test_gradients_match_finite_differences(corpus_dir, tmp_path):
    """Directional derivatives along random directions: grad . v == (L(p + ev) - L(p - ev)) / 2e.

    Parameters and activations are f64 where the model allows it; norms and the SSD scan
    compute in f32 by design, so e is 1e-3 with Richardson extrapolation and the tolerance
    1e-3 (a wrong or missing gradient path is off by far more).
    """
    cfg, tc, data = _setup(corpus_dir, tmp_path)
    with jax.enable_x64(True):
        apply = make_apply(cfg, "float64")
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), init_params(cfg, 0))
        tokens = jnp.asarray(data.train_rows[:2, :17])

        @jax.jit
        def loss(p):
            nats, mask = token_nats(apply, p, tokens)
            return nats.sum() / mask.sum()

        grads = jax.grad(loss)(params)
        rng = np.random.default_rng(0)
        for _ in range(3):
            v = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), params)

            def fd(eps, v=v):
                plus = loss(jax.tree.map(lambda x, dv: x + eps * dv, params, v))
                minus = loss(jax.tree.map(lambda x, dv: x - eps * dv, params, v))
                return float(plus - minus) / (2 * eps)

            fd_value = (4 * fd(1e-3) - fd(2e-3)) / 3  # Richardson: the eps**2 term cancels
            analytic = sum(jnp.vdot(g, d) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(v),
                                                          strict=True))
            np.testing.assert_allclose(float(analytic), fd_value, rtol=1e-3)


def test_bf16_compute_keeps_f32_master_weights(corpus_dir, tmp_path):
    cfg, tc, data = _setup(corpus_dir, tmp_path, compute_dtype="bfloat16")
    steps = make_steps(cfg, tc)
    params = init_params(cfg, 0)
    opt_state = steps.tx.init(params)
    batch = jnp.asarray(data.train_rows[:tc.batch_size]).reshape(1, tc.batch_size, -1)
    new, _, metrics = steps.train(params, opt_state, batch)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(new))
    assert np.isfinite(float(metrics["loss"]))
