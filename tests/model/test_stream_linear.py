"""Gated MLPs' decode steps through the stream GEMM's gated form
(pallas_kernels/stream_gemm.stream_glu, its XLA reference here): fusion stacks the
layers' fused gate/up kernels into one array, every gate/up Linear reads its own row,
and a decode step through the stack, the gate/up product and silu(gate) * up in one
call, gives the logits and caches of the same fused model without the stack (each
layer's own kernel through XLA's dot, the activation in XLA)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.config import LayerSpec, MLPConfig, ModelConfig
from hybrid_jax.fusion import fuse_projections
from hybrid_jax.layers import linear
from hybrid_jax.model import CausalLM
from pallas_kernels import stream_gemm
from tests.model.test_decode_glue_paths import _config, _randomize_norms
from tests.model.test_ragged_forward import MAX_LEN, Harness, decode_after


def _fused(monkeypatch, stream: bool):
    monkeypatch.setattr(linear, "STREAM_GEMM", stream)
    monkeypatch.setattr(linear, "STREAM_GEMM_IMPL", "reference")
    # The tiny model's MLPs (64 wide) are below the H100 rule's widths: any shape here.
    monkeypatch.setattr(linear, "glu_config", lambda rows, n, k: stream_gemm.StreamConfig())
    model = CausalLM(_config(), rngs=nnx.Rngs(4))
    _randomize_norms(model, 1)
    return model, fuse_projections(model)


def _stacked(model) -> list[linear.Linear]:
    return [lin for _, lin in nnx.iter_graph(model)
            if isinstance(lin, linear.Linear) and lin.stack_row is not None]


def test_fusion_stacks_gate_up_kernels(monkeypatch):
    _, fused = _fused(monkeypatch, True)
    _, plain = _fused(monkeypatch, False)
    mlps = [(g.mlp, w.mlp) for g, w in zip(fused.layers, plain.layers, strict=True) if g.mlp is not None]
    assert len(mlps) == 5
    stack = mlps[0][0].gate_up_proj.kernel
    assert stack[...].shape == (5, *mlps[0][1].gate_up_proj.kernel.shape)
    for row, (g, w) in enumerate(mlps):
        assert g.gate_up_proj.kernel is stack and g.gate_up_proj.stack_row == row
        assert w.gate_up_proj.stack_row is None
        np.testing.assert_array_equal(np.asarray(g.gate_up_proj.weight()),
                                      np.asarray(w.gate_up_proj.kernel[...]))
    # Nothing else is stacked, and the stack is one shared parameter in the model's state.
    assert {id(lin) for lin in _stacked(fused)} == {id(g.gate_up_proj) for g, _ in mlps}
    assert not _stacked(plain)
    _, state = nnx.split(fused)
    _, plain_state = nnx.split(plain)
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(plain_state)) - 5 + 1


def test_decode_through_stack_equals_per_layer_kernels(monkeypatch):
    calls = []
    real = stream_gemm.stream_glu

    def counted(x, w, **kw):
        calls.append((w.shape, kw["row0"], kw["n"]))
        return real(x, w, **kw)

    monkeypatch.setattr(linear, "stream_glu", counted)
    prompts = [np.random.default_rng(n).integers(0, 64, n).tolist() for n in (3, 9, 14)]

    def serve(stream: bool):
        _, fused = _fused(monkeypatch, stream)
        h = Harness(fused, len(prompts), fresh=True)
        h.run(dict(enumerate(prompts)), decode=False)
        return decode_after(h, prompts, MAX_LEN - 14 - 1), h.caches, fused

    got, got_caches, fused = serve(True)
    # Every MLP's gate/up took the gated stream GEMM (the patched config takes any rows),
    # each at its own rows of the stack: gate rows [2 n row, 2 n row + n), up rows after.
    rows = {lin.stack_row: lin.kernel.shape[1] // 2 for lin in _stacked(fused)}
    assert len(rows) == 5
    assert {(row0 // (2 * n), n) for _, row0, n in calls} == set(rows.items())
    assert {w for w, *_ in calls} == {(5 * 2 * rows[0], fused.cfg.hidden_size)}
    seen = len(calls)
    want, want_caches, _ = serve(False)
    assert len(calls) == seen, "the run without the stack called the stream GEMM"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    for g, w in zip(jax.tree.leaves(got_caches), jax.tree.leaves(want_caches), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def test_launch_rule(monkeypatch):
    """glu_config: decode row counts 8-64, halves of >= 2048 in whole 64-row tiles, depth in
    128s; a malformed override names its variable."""
    monkeypatch.delenv("HYBRID_JAX_STREAM_GEMM_CONFIG", raising=False)
    assert linear.glu_config(64, 5632, 2048) == stream_gemm.StreamConfig(tn=64, tk=128, stages=4, swap=False)
    assert linear.glu_config(8, 5632, 2048).swap
    for rows, n, k in [(1, 5632, 2048), (128, 5632, 2048), (8, 1024, 2048), (8, 5600, 2048), (8, 5632, 2000)]:
        assert linear.glu_config(rows, n, k) is None, (rows, n, k)
    monkeypatch.setenv("HYBRID_JAX_STREAM_GEMM_CONFIG", "128,128,3,1")
    assert linear.glu_config(8, 5696, 2048) is None  # 5696 = 89 x 64: not whole 128-row tiles
    assert linear.glu_config(8, 4096, 2048) == stream_gemm.StreamConfig(tn=128, tk=128, stages=3, swap=True)
    monkeypatch.setenv("HYBRID_JAX_STREAM_GEMM_CONFIG", "128,128")
    with pytest.raises(ValueError, match="HYBRID_JAX_STREAM_GEMM_CONFIG"):
        linear.glu_config(8, 4096, 2048)


HOPPER = jax.default_backend() == "gpu" and getattr(jax.devices()[0], "compute_capability", "") == "9.0"


@pytest.mark.skipif(not HOPPER, reason="the Mosaic GPU kernel runs on Hopper GPUs only")
@pytest.mark.parametrize("rows", [8, 64])
def test_hopper_gated_mlps_read_their_rows(rows):
    """On an H100 / H200, with the engine's own launch rule (no patches): each fused bf16
    MLP of a model whose widths the rule takes returns, through the kernel,
    silu(gate * multiplier) * up of its own layer's weights (float64 from the unfused
    model's gate_proj and up_proj)."""
    cfg = ModelConfig(architecture="native", vocab_size=64, hidden_size=128,
                      layers=(LayerSpec("mlp"),) * 3, mlp=MLPConfig(2048, gate_multiplier=0.75),
                      max_position_embeddings=MAX_LEN)
    model = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3))
    want_w = [(np.asarray(b.mlp.gate_proj.kernel[...], np.float64),
               np.asarray(b.mlp.up_proj.kernel[...], np.float64)) for b in model.layers]
    fused = fuse_projections(model)
    assert [b.mlp.gate_up_proj.stack_row for b in fused.layers] == [0, 1, 2]
    x = jax.random.normal(jax.random.PRNGKey(rows), (rows, 128), jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    for block, (wg, wu) in zip(fused.layers, want_w, strict=True):
        got = np.asarray(jax.jit(lambda x, m=block.mlp: m.hidden(x))(x), np.float64)
        gate, up = 0.75 * (x64 @ wg), x64 @ wu
        want = gate / (1 + np.exp(-gate)) * up
        np.testing.assert_allclose(got, want, atol=3e-2 * np.abs(want).max(), rtol=3e-2)
