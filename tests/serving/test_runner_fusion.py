"""The runner serves a fused copy of the model (hybrid_jax/fusion.py) unless
HYBRID_JAX_FUSE_PROJECTIONS=0; the model handed to it is left as it was, and a value
other than 0 / 1 is refused naming the variable."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.fusion import is_fused
from hybrid_jax.layers import linear
from hybrid_jax.model import CausalLM
from pallas_kernels.stream_gemm import StreamConfig
from serving.runner.packing import unpack
from serving.runner.runner import ModelRunner
from tests.model.test_fused_projections import CONFIGS


def _runner(model):
    return ModelRunner(model, num_pages=(9,) * len(model.cfg.windows), page_size=8, num_slots=3,
                       ring_widths=(4,) * len(model.cfg.windows), max_num_seqs=2,
                       max_num_batched_tokens=16)


@pytest.mark.parametrize("env,fused", [(None, True), ("1", True), ("0", False)])
def test_runner_fuses_unless_switched_off(monkeypatch, env, fused):
    if env is None:
        monkeypatch.delenv("HYBRID_JAX_FUSE_PROJECTIONS", raising=False)
    else:
        monkeypatch.setenv("HYBRID_JAX_FUSE_PROJECTIONS", env)
    model = CausalLM(CONFIGS["hybrid"], rngs=nnx.Rngs(0))
    runner = _runner(model)
    served = nnx.merge(runner.graphdef, unpack(runner.layout, runner.params))
    assert is_fused(served) == fused
    assert not is_fused(model) and model.layers[0].attention.q_proj is not None
    # The packed parameters hold the same numbers either way (fusion moves, never changes).
    total = sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in
                jax.tree.leaves(nnx.state(model)))
    packed = sum(float(jnp.sum(jnp.abs(x.astype(jnp.float32)))) for x in
                 jax.tree.leaves(nnx.state(served)))
    np.testing.assert_allclose(packed, total, rtol=1e-6)


def test_runner_refuses_a_bad_switch(monkeypatch):
    monkeypatch.setenv("HYBRID_JAX_FUSE_PROJECTIONS", "yes")
    with pytest.raises(ValueError, match="HYBRID_JAX_FUSE_PROJECTIONS"):
        _runner(CausalLM(CONFIGS["hybrid"], rngs=nnx.Rngs(0)))


def test_runner_gives_kernel_stacks_their_own_buffers(monkeypatch):
    """Where the stream GEMM serves the gated MLPs (patched on here: its XLA reference,
    any shape), fusion stacks their gate/up kernels and the runner packs the stack into a
    buffer of its own, exactly its size, so the kernel reads it in place."""
    monkeypatch.setattr(linear, "STREAM_GEMM_IMPL", "reference")
    monkeypatch.setattr(linear, "glu_config", lambda rows, n, k: StreamConfig())
    runner = _runner(CausalLM(CONFIGS["hybrid"], rngs=nnx.Rngs(0)))
    served = nnx.merge(runner.graphdef, unpack(runner.layout, runner.params))
    shapes = {tuple(lin.kernel[...].shape) for _, lin in nnx.iter_graph(served)
              if isinstance(lin, linear.Linear) and lin.stack_row is not None}
    assert len(shapes) == 1
    (shape,) = shapes
    (b,) = [b for b, _, s in runner.layout.leaves if s == shape]
    assert [s for bj, _, s in runner.layout.leaves if bj == b] == [shape]
    assert runner.layout.sizes[b] == int(np.prod(shape)) == runner.params[b].size


@pytest.mark.parametrize("fp8", [False, True])
def test_runner_gives_expert_stacks_their_own_buffers(fp8):
    """The grouped GEMM reads each MoE layer's expert stacks (and FP8 stacks' block scales)
    in place: each is packed alone in a buffer exactly its size (a slice of a shared buffer
    would be copied out before the kernel on every step), and the numbers are the model's."""
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.presets import load_preset
    from hybrid_jax.quantization import quantize_model

    model = CausalLM(load_preset("qwen3.5-moe-tiny"), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    if fp8:
        quantize_model(model, "fp8")
    def held(moe):  # its stacks, and their scales where FP8 (the MTP head's MoE stays bf16)
        names = [n for n in MoE.STACKS if getattr(moe, n) is not None]
        return names + [f"{n}_scale" for n in names if getattr(moe, f"{n}_scale") is not None]

    moes = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
    stacks = [getattr(m, n)[...] for m in moes for n in held(m)]
    assert sum(len(held(m)) == 4 for m in moes) == (len(moes) - 1 if fp8 else 0)
    runner = _runner(model)
    shapes = {tuple(s.shape) for s in stacks}
    own = [(b, s) for b, _, s in runner.layout.leaves if s in shapes]
    assert len(own) == len(stacks)
    for b, s in own:
        assert [x for bj, _, x in runner.layout.leaves if bj == b] == [s]
        assert runner.layout.sizes[b] == int(np.prod(s)) == runner.params[b].size
    served = nnx.merge(runner.graphdef, unpack(runner.layout, runner.params))
    got = [getattr(m, n)[...] for _, m in nnx.iter_graph(served) if isinstance(m, MoE) for n in held(m)]
    for a, b in zip(stacks, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # ... and held once: the runner's buffer is the model's own array, not a copy of it
    held_at = {x.unsafe_buffer_pointer() for x in stacks}
    assert {runner.params[b].unsafe_buffer_pointer() for b, _ in own} == held_at


def test_memory_plan_counts_the_expert_stacks_once(monkeypatch):
    """The engine plans its pools with the bytes its runner adds while the loaded model is
    held: the expert stacks already on the device are packed as they are (no copy), so they
    are not subtracted a second time; every other parameter is."""
    from hybrid_jax.fusion import shared_stack_bytes
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.loading import load_model
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine

    lm = load_model("qwen3.5-moe-tiny", dtype="bfloat16")
    dev = jax.devices()[0]
    stacks = [getattr(m, n)[...] for _, m in nnx.iter_graph(lm.model) if isinstance(m, MoE)
              for n in MoE.STACKS if getattr(m, n) is not None]
    assert shared_stack_bytes(lm.model, dev) == sum(x.nbytes for x in stacks) > 0
    assert shared_stack_bytes(lm.model, object()) == 0  # none of them on that device
    seen = {}
    import serving.engine.llm_engine as engine_module

    real = engine_module.plan_pools

    def spy(*a, **kw):
        seen["weights"] = kw["weight_bytes"]
        return real(*a, **kw)

    monkeypatch.setattr(engine_module, "plan_pools", spy)
    LLMEngine(lm, EngineConfig(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=32),
              show_progress=False)
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(lm.model)))
    assert seen["weights"] == total - sum(x.nbytes for x in stacks)
