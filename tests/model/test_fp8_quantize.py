"""Quantization at load (`quantization="fp8"`): the decoder Linears become FP8 with 128 x 128
block scales, in memory, and the model's logits stay close to the unquantized model's;
unsupported settings are refused naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import tensor_parallel as tp
from hybrid_jax.layers.fp8 import FP8_MAX
from hybrid_jax.layers.linear import Linear
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.startup import quantized_copy, tp_aligned


def _linears(model) -> dict[str, Linear]:
    return {".".join(map(str, p)): m for p, m in nnx.iter_graph(model) if isinstance(m, Linear)}


def test_quantized_model_is_fp8_in_memory_and_close_to_the_original():
    # The shipped default model (trained: logits with structure, unlike a random model's),
    # quantized as the engine does it (a copy).
    base = load_model("default")
    quant = quantized_copy(base, "fp8")
    lins, base_lins = _linears(quant.model), _linears(base.model)
    assert lins and all(lin.quantized and lin.block == 128 for lin in lins.values())
    for name, lin in lins.items():
        assert lin.kernel[...].dtype == jnp.float8_e4m3fn and lin.scale[...].dtype == jnp.float32
        w = np.asarray(base_lins[name].kernel[...])
        # each (edge) block's largest magnitude maps to the top of e4m3; the error is e4m3's rounding
        assert np.asarray(lin.scale[...]).max() == pytest.approx(np.abs(w).max() / FP8_MAX, rel=1e-6)
        kernel, scale = np.asarray(lin.kernel[...]), np.asarray(lin.scale[...])
        full = np.kron(scale, np.ones((128, 128), np.float32))[:w.shape[0], :w.shape[1]]
        deq = kernel.astype(np.float32) * full
        assert np.abs(deq - w).max() <= np.abs(w).max() * 2.0**-4
    assert quant.model.embed.embedding[...].dtype == jnp.float32  # embeddings and norms untouched
    assert quant.model.final_norm.weight[...].dtype == jnp.float32
    fp8_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(quant.model)) if x.dtype == jnp.float8_e4m3fn)
    assert fp8_bytes == sum(lin.kernel[...].size for lin in lins.values())

    ids = jnp.asarray(np.random.default_rng(0).integers(0, base.config.vocab_size, (2, 32)), jnp.int32)
    ref, ours = (np.asarray(jax.jit(lambda x, m=m: m(x))(ids)).reshape(-1, base.config.vocab_size)
                 for m in (base.model, quant.model))
    cos = np.sum(ref * ours, -1) / (np.linalg.norm(ref, axis=-1) * np.linalg.norm(ours, axis=-1))
    assert cos.min() > 0.99, cos.min()
    assert not np.array_equal(ref, ours)  # really quantized


def test_load_and_engine_quantize_and_refuse_unknown_quantization():
    quant = load_model("default", quantization="fp8")
    assert all(lin.quantized for lin in _linears(quant.model).values())
    lm = load_model("default")
    copy = quantized_copy(lm, "fp8")  # the engine quantizes a copy of a LoadedModel it is given
    assert all(lin.quantized for lin in _linears(copy.model).values())
    assert not any(lin.quantized for lin in _linears(lm.model).values())  # the caller's model as it was
    assert quantized_copy(copy, "fp8") is copy and quantized_copy(lm, None) is lm
    # the default model's k_proj has 64 outputs (one KV head): halves of one 128-block cannot split
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the FP8 weight .*k_proj .* scale blocks"):
        tp.check_weights_shardable(quant.model, 2)
    tp.check_weights_shardable(lm.model, 2)
    # ... so the engine holds those in the compute dtype at tensor_parallel_size=2 (the values
    # the FP8 product computes with: same logits), on a copy of a caller's model
    at_tp = tp_aligned(quant, 2, copy=True)
    dense = {p for p, lin in _linears(at_tp.model).items() if not lin.quantized}
    assert "layers.0.attention.k_proj" in dense
    assert dense == {p for p, _ in tp.unaligned_fp8_linears(quant.model, 2)}
    assert all(lin.quantized for lin in _linears(quant.model).values())
    tp.check_weights_shardable(at_tp.model, 2)
    assert tp_aligned(at_tp, 2, copy=True) is at_tp
    ids = jnp.asarray([[5, 9, 200, 17, 3, 99]], jnp.int32)
    before, after = (np.asarray(jax.jit(lambda x, m=m: m(x))(ids)) for m in (quant.model, at_tp.model))
    np.testing.assert_allclose(after, before, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="quantization='int4'"):
        EngineConfig(quantization="int4")
    with pytest.raises(ValueError, match="quantization='int4'"):
        load_model("default", quantization="int4")


def test_cli_subcommands_take_quantization():
    from serving.entrypoints.cli_args import build_parser

    for command, rest in (("generate", ["x"]), ("serve", [])):
        assert build_parser().parse_args([command, "--quantization", "fp8", *rest]).quantization == "fp8"
        assert build_parser().parse_args([command, *rest]).quantization is None


def test_expert_stacks_quantize_in_slices_as_a_whole():
    """quantize_model quantizes an expert stack a few experts at a time (bounded f32
    temporaries, so a 35B-A3B's bf16 layers fit one GPU while being quantized): the same
    kernels and scales as the whole stack at once, an uneven last slice included."""
    from hybrid_jax.layers.fp8 import quantize_experts as _quantize_experts
    from hybrid_jax.layers.fp8 import quantize_stack

    w = jnp.asarray(np.random.default_rng(1).normal(size=(7, 64, 96)).astype(np.float32))
    for glu in (False, True):
        whole = quantize_stack(w, 32, glu=glu)
        sliced = _quantize_experts(w, 32, glu=glu, chunk_bytes=3 * 64 * 96 * 4)  # slices of 3, 3, 1
        for a, b in zip(whole, sliced, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_expert_stacks_quantize_per_expert_and_gated_half():
    """quantize_stack (quantization="fp8" of MoE layers): each expert's gate and up halves
    block-wise on their own grids (40 columns per half, blocks of 32: edge blocks), every
    block's largest magnitude at the top of e4m3, the error e4m3's rounding."""
    from hybrid_jax.layers.fp8 import quantize_stack
    from pallas_kernels.grouped_gemm import dequantize_stack

    w = np.random.default_rng(0).normal(size=(3, 70, 80)).astype(np.float32)
    w[1, :, 40:] *= 100  # expert 1's up half on another scale than its gate half
    q, s = quantize_stack(jnp.asarray(w), 32, glu=True)
    assert q.dtype == jnp.float8_e4m3fn and s.shape == (3, 3, 4)  # 3 row blocks, 2 + 2 column blocks
    for j in range(3):
        for half in range(2):
            for rb in range(3):
                for cb in range(2):
                    blk = w[j, rb * 32:(rb + 1) * 32, half * 40 + cb * 32:half * 40 + min((cb + 1) * 32, 40)]
                    want = np.abs(blk).max() / FP8_MAX
                    assert float(s[j, rb, half * 2 + cb]) == pytest.approx(want, rel=1e-6)
    deq = np.asarray(dequantize_stack(q, s, 32, True, jnp.float32))
    for j in range(3):
        for half in (slice(0, 40), slice(40, 80)):
            assert np.abs(deq[j, :, half] - w[j, :, half]).max() <= np.abs(w[j, :, half]).max() * 2.0**-4
