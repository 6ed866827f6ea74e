"""Linear layers on the skinny GEMM path equal the plain XLA path.

`linear.SKINNY_GEMM_IMPL = "interpret"` forces the GPU decision on the CPU (the
Pallas kernel in interpret mode; compiled on a GPU); SKINNY_GEMM_MAX_ROWS = 0 is the
plain path. A one-layer native-tiny (untied LM head, so the head is a Linear too,
with n = 264 not a multiple of the column block) runs a decode-sized forward both
ways: every Linear must take the skinny path, and the logits must agree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import linear
from hybrid_jax.layers.linear import Linear
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset
from pallas_kernels.skinny_gemm import skinny_matmul

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _model() -> tuple[nnx.GraphDef, nnx.State]:
    """Built in one jitted init (an eager one compiles every op of it, one at a time)."""
    cfg = load_preset("native-tiny")
    cfg = dataclasses.replace(cfg, layers=cfg.layers[:1], tie_embeddings=False)
    make = lambda: CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    return nnx.graphdef(nnx.eval_shape(make)), jax.jit(lambda: nnx.state(make()))()


def _counting(monkeypatch) -> list[tuple[int, ...]]:
    """Patches linear.skinny_matmul to record the shapes of x it is called with."""
    calls = []

    def counted(x, w, **kw):
        calls.append(x.shape)
        return skinny_matmul(x, w, **kw)

    monkeypatch.setattr(linear, "skinny_matmul", counted)
    return calls


def test_skinny_path_matches_plain_forward(monkeypatch):
    """A decode-sized forward, jitted: 13 sequences of one token each."""
    graph, state = _model()
    model = nnx.merge(graph, state)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.cfg.vocab_size, (13, 1)))
    calls = _counting(monkeypatch)

    def logits(max_rows):
        monkeypatch.setattr(linear, "SKINNY_GEMM_MAX_ROWS", max_rows)  # read when the jit traces
        forward = jax.jit(lambda s, t: nnx.merge(graph, s)(t))
        return np.asarray(forward(state, tokens))

    monkeypatch.setattr(linear, "SKINNY_GEMM_IMPL", KERNEL_IMPL)
    plain = logits(0)  # XLA's dot
    assert calls == []
    skinny = logits(256)
    linears = sum(isinstance(mod, Linear) for _, mod in nnx.iter_graph(model))
    assert len(calls) == linears and set(calls) <= {(13, 128), (13, 256)}, calls
    err = np.linalg.norm(skinny - plain) / np.linalg.norm(plain)
    assert err < 2e-2, err  # bf16 projections summed in another order: ulp-level flips


def test_row_limit_and_dtype_gate(monkeypatch):
    calls = _counting(monkeypatch)
    monkeypatch.setattr(linear, "SKINNY_GEMM_IMPL", KERNEL_IMPL)
    monkeypatch.setattr(linear, "SKINNY_GEMM_MAX_ROWS", 256)  # the default is off
    w = jnp.ones((32, 16), jnp.bfloat16)
    x = jnp.ones((2, 5, 32), jnp.bfloat16)  # 10 rows
    assert linear.matmul(x, w).shape == (2, 5, 16) and len(calls) == 1
    for rows in (8, 0):
        monkeypatch.setattr(linear, "SKINNY_GEMM_MAX_ROWS", rows)
        linear.matmul(x, w)
    linear.matmul(x[..., :24], w[:24])  # k = 24 is not a multiple of 16: XLA
    monkeypatch.setattr(linear, "SKINNY_GEMM_MAX_ROWS", 256)
    linear.matmul(x, w.astype(jnp.float32))  # f32 weights keep XLA's dot
    assert len(calls) == 1


def test_max_rows_from_environment(monkeypatch):
    monkeypatch.setenv("HYBRID_JAX_SKINNY_GEMM_MAX_ROWS", "64")
    assert linear._max_rows_from_env() == 64
    monkeypatch.delenv("HYBRID_JAX_SKINNY_GEMM_MAX_ROWS")
    assert linear._max_rows_from_env() == 0  # off by default (see linear.py)
    for bad in ("-1", "lots"):
        monkeypatch.setenv("HYBRID_JAX_SKINNY_GEMM_MAX_ROWS", bad)
        with pytest.raises(ValueError, match="HYBRID_JAX_SKINNY_GEMM_MAX_ROWS"):
            linear._max_rows_from_env()
