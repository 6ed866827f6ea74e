"""Tensor parallelism (issue 15): sharded serving equals single-device serving.

The engine checks run in one child process that sees 4 CPU devices
(`tensor_parallel_child.py`; XLA_FLAGS must be set before JAX starts, and this process
has already started it with one device). For three tiny models that together carry every
layer kind and sharding rule of the served architectures, at tensor_parallel_size 2 and
4: greedy tokens equal tensor_parallel_size=1 (margin-aware, logprobs close) with chunked
prefill and preemption, batched == solo, seeded sampling unchanged, no compilation while
serving, parameters split across the devices; and the refusals. Here, in-process: the
sharding rules give every parameter of every shipped preset its local shape, and bad
settings are refused with messages naming tensor_parallel_size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from hybrid_jax import tensor_parallel as tp
from hybrid_jax.config import LayerKind
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset, preset_names
from serving.engine.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]


# The suite's flags (tests/conftest.py) and the forced host devices.
FLAGS = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()


@pytest.fixture(scope="module")
def child_results() -> dict[str, object]:
    env = dict(os.environ, XLA_FLAGS=FLAGS,
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("tensor_parallel_child.py"))],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ssm", "recurrent", "shared"])
def test_sharded_engine_equals_single_device(child_results, model):
    assert "child crashed" not in child_results, child_results["child crashed"]
    mine = {k: v for k, v in child_results.items() if k.startswith(f"{model}:")}
    per_size = 7 if model == "ssm" else 6  # checks per tensor-parallel size, + 1 reference check
    sizes = {k.split("tp=")[1].split()[0] for k in mine if "tp=" in k}  # the child's TP_SIZES
    assert "2" in sizes and len(mine) == 1 + per_size * len(sizes), sorted(mine)
    failed = {k: v for k, v in mine.items() if v is not True}
    assert not failed, failed


@pytest.mark.slow
def test_moe_kernel_runs_on_device_shards(child_results):
    """The grouped GEMM kernel (interpret mode) under shard_map on width-split experts,
    bf16/f32 and FP8 (weights and block scales split by tensor_parallel's rules)."""
    assert child_results.get("moe kernel on device shards == dense") is True, child_results
    assert child_results.get("fp8 moe kernel on device shards == dense") is True, child_results


@pytest.mark.slow
def test_mtp_speculation_at_tp2_equals_plain_greedy(child_results):
    """MTP drafts verified per device shard (n-gram speculation shares the verification step)."""
    assert "child crashed" not in child_results, child_results["child crashed"]
    mine = {k: v for k, v in child_results.items() if k.startswith("mtp:")}
    assert len(mine) == 2 and all(v is True for v in mine.values()), mine


@pytest.mark.slow
def test_sharded_fp8_weights_and_kv_equal_single_device(child_results):
    """FP8 weights and FP8 KV pages (per-head scales split with the heads) at tp=2 == tp=1."""
    assert "child crashed" not in child_results, child_results["child crashed"]
    mine = {k: v for k, v in child_results.items() if k.startswith("fp8:")}
    assert len(mine) == 5 and all(v is True for v in mine.values()), mine


def test_fp8_shards_hold_the_shards_of_the_dequantized_weight():
    """Every FP8 Linear's kernel and block scales, and every FP8 expert stack's (the MoE
    layer's gate/up halves and down, split by width), split for each of 2 devices,
    dequantize to that device's shard of the dequantized global weight (4 x 4 blocks: whole
    blocks at every split of this model); the local model holds FP8 of those shapes."""
    from hybrid_jax.quantization import quantize_model
    from tests.serving.tensor_parallel_child import models

    models_ = {}
    for cfg in (models()["ssm"], _moe_only(models()["recurrent"])):
        models_[cfg.architecture] = model = quantize_model(CausalLM(cfg, rngs=nnx.Rngs(0)), "fp8", block=4)
        _check_fp8_shards(cfg, model)
    cfg = models()["ssm"]
    with pytest.raises(ValueError, match="tensor_parallel_size=2: the FP8 weight .* scale blocks"):
        tp.check_weights_shardable(quantize_model(CausalLM(cfg, rngs=nnx.Rngs(0)), "fp8", block=16), 2)
    # expert width 32 over 16 devices: 2 columns each, half a 4-block
    with pytest.raises(ValueError, match="tensor_parallel_size=16: the FP8 experts .* scale blocks"):
        tp.check_weights_shardable(models_["tp-test-recurrent"], 16)


def _moe_only(cfg):
    """`cfg`'s gated experts (no shared expert) as the only layer kind."""
    layer = dataclasses.replace(cfg.layers[0], kind=LayerKind.MLP, moe=True)
    return dataclasses.replace(cfg, layers=(layer,), moe=dataclasses.replace(cfg.moe, shared_expert=None),
                               attention=None, gated_deltanet=None, mamba1=None,
                               rglru=None, short_conv=None, mamba2=None, mlp=None)


def _check_fp8_shards(cfg, model):
    from hybrid_jax.layers.fp8 import dequantize
    from pallas_kernels.grouped_gemm import dequantize_stack

    fp8 = tp.fp8_layout(model)
    assert cfg.moe is None or {"layers.0.moe.gate_up", "layers.0.moe.down"} <= set(fp8)
    tp.check_weights_shardable(model, 2)
    state = nnx.state(model)
    local = nnx.state(tp.local_abstract_model(cfg, 2, model.dtype, fp8))
    glob = {tp._names(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]}
    names = [tp._names(p) for p, _ in jax.tree_util.tree_flatten_with_path(local)[0]]
    deq = lambda k, s: np.asarray(dequantize(jax.numpy.asarray(k), jax.numpy.asarray(s), 4, np.float32))  # noqa: E731
    for d in range(2):
        held = dict(zip(names, tp.shard_params(cfg, state, 2, d, local, fp8), strict=True))
        for path in fp8:
            key = tuple(int(x) if x.isdigit() else x for x in path.split("."))
            if key[-2] == "moe":  # an expert stack [e, in, out] and its scales
                k, s = key, (*key[:-1], f"{key[-1]}_scale")
                dq = lambda q, sc, glu=key[-1] == "gate_up": np.asarray(dequantize_stack(  # noqa: E731
                    jax.numpy.asarray(q), jax.numpy.asarray(sc), 4, glu, np.float32))
            else:
                k, s, dq = (*key, "kernel"), (*key, "scale"), deq
            assert held[k].dtype == jax.numpy.float8_e4m3fn
            want = tp.shard_param(k, dq(glob[k], glob[s]), cfg, 2, d)
            np.testing.assert_array_equal(dq(held[k], held[s]), want, err_msg=path)
    plain = tp.param_bytes_per_device(cfg, 2, model.dtype)
    assert tp.param_bytes_per_device(cfg, 2, model.dtype, fp8) < plain


@pytest.mark.slow
def test_engine_refuses_what_cannot_be_sharded(child_results):
    refusals = {k: v for k, v in child_results.items() if "refused" in k}
    assert len(refusals) == 2 and all(v is True for v in refusals.values()), refusals


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_shards_to_its_local_shapes(name):
    cfg = load_preset(name)
    # One layer of each (kind, window): the shapes of the others repeat them.
    cfg = dataclasses.replace(cfg, layers=tuple(dict.fromkeys(cfg.layers)))
    glob = jax.tree_util.tree_flatten_with_path(nnx.state(
        nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0)))))[0]
    for n in (2, 4):
        try:
            local = nnx.state(tp.local_abstract_model(cfg, n, jax.numpy.float32))
        except ValueError as e:  # RecurrentGemma's 10 heads on 4 devices
            assert f"tensor_parallel_size={n}" in str(e) and n == 4 and "heads" in str(e), str(e)
            continue
        total = 0
        for (path, x), want in zip(glob, jax.tree.leaves(local), strict=True):
            shape = tp.shard_shape(tp._names(path), x.shape, cfg, n)
            assert shape == want.shape, (tp._names(path), shape, want.shape)
            total += int(np.prod(shape))
        # Only norms, biases of row-parallel layers, replicated KV heads / groups and adapters'
        # down LoRAs are repeated on every device.
        assert total <= (1 / n + 0.1) * sum(x.size for _, x in glob)


@pytest.mark.parametrize("name", ["falcon-mamba-7b", "jamba-mini-1.5"])
def test_mamba1_presets_split_by_channel(name):
    """At N = 2 a Mamba1 layer holds half of d_inner (8192 -> 4096): in_proj's xs and z
    halves, the conv, dt_proj's outputs, dt_bias, A_log, D, out_proj's rows and the conv and
    SSM states; x_proj's rows too, its dt / B / C summed over the devices (psum) before the
    norms. Jamba-Mini-1.5 (52B, 104 GB in bf16) fits an 80 GB H100 only split."""
    import jax.numpy as jnp

    from hybrid_jax.cache import init_caches

    full = load_preset(name)
    cfg = dataclasses.replace(full, layers=tuple(dict.fromkeys(full.layers)))
    local = tp.local_abstract_model(cfg, 2, jnp.bfloat16)
    i = next(j for j, s in enumerate(cfg.layers) if s.kind == LayerKind.MAMBA1)
    mixer = local.layers[i].mamba1
    shapes = {".".join(map(str, p)): tuple(x.shape) for p, x in nnx.to_flat_state(nnx.state(mixer))}
    assert shapes == {"in_proj.kernel": (4096, 8192), "conv_weight": (4096, 4), "conv_bias": (4096,),
                      "x_proj.kernel": (4096, 256 + 2 * 16), "dt_proj.kernel": (256, 4096),
                      "dt_bias": (4096,), "A_log": (4096, 16), "D": (4096,),
                      "out_proj.kernel": (4096, 4096)} | (
                         {f"{k}_norm.weight": (w,) for k, w in (("dt", 256), ("b", 16), ("c", 16))}
                         if name.startswith("jamba") else {}), shapes
    assert mixer.x_proj.reduce_axis == mixer.out_proj.reduce_axis == tp.AXIS
    assert mixer.in_proj.reduce_axis is None and mixer.dt_proj.reduce_axis is None
    lc = tp.local_config(cfg, 2)
    states = jax.eval_shape(lambda: init_caches(lc, num_pages=(1,) * len(lc.windows), page_size=16,
                                                num_slots=3, dtype=jnp.bfloat16)).mamba1
    assert states.conv.shape[1:] == (3, 3, 4096) and states.ssm.shape[1:] == (3, 4096, 16)
    assert tp.cache_axes(states) == type(states)(3, 2)  # [n, S, ...]: the channel axes
    if name.startswith("jamba"):
        a, moe = lc.attention, lc.moe
        assert (a.num_heads, a.num_kv_heads, moe.intermediate_size) == (16, 4, 7168)
        per_device = tp.param_bytes_per_device(full, 2, jnp.bfloat16)
        assert 48e9 < per_device < 56e9, per_device  # half of ~104 GB (the untied head split too)


def test_fused_local_models_sum_like_the_unfused_ones():
    """The runner fuses each device's local model (serving/runner/runner.py, hybrid_jax/fusion.py):
    a parallel layer's row-parallel o_proj and out_proj become one row-parallel fused_out,
    whose one psum over the devices gives the sum of the unfused products; the down-
    projection is held transposed and keeps its psum. (The engines at N = 2 serve fused
    local models in the child; native-tiny's layers, checked here, are the ones whose
    fused_out is row-parallel.)"""
    from hybrid_jax.fusion import fuse_projections

    cfg = load_preset("native-tiny")
    state = nnx.state(CausalLM(cfg, dtype=np.float32, rngs=nnx.Rngs(0)))
    graph, local = nnx.split(tp.local_abstract_model(cfg, 2, np.float32))
    shard = lambda d: nnx.merge(graph, jax.tree.unflatten(  # noqa: E731
        jax.tree.structure(local), tp.shard_params(cfg, state, 2, d, local)))
    unfused = [shard(d) for d in range(2)]
    fused = [fuse_projections(shard(d)) for d in range(2)]
    rng = np.random.default_rng(0)

    def psum_over_devices(linears, x):  # each device's Linear on its x, under the mesh axis
        g, _ = nnx.split(linears[0])
        states = jax.tree.map(lambda *v: jax.numpy.stack(v), *[nnx.state(lin) for lin in linears])
        return np.asarray(jax.vmap(lambda st, xd: nnx.merge(g, st)(xd), axis_name=tp.AXIS)(states, x))

    for i, block in enumerate(fused[0].layers):
        assert block.fused_in is not None and block.fused_out.reduce_axis == tp.AXIS, i
        assert block.fused_out.transposed and block.mlp.down_proj.transposed, i
        assert block.mlp.down_proj.reduce_axis == tp.AXIS, i
        pairs = (([m.layers[i].fused_out for m in fused],
                  [np.concatenate([m.layers[i].attention.o_proj.kernel[...],
                                   m.layers[i].mamba.out_proj.kernel[...]]) for m in unfused]),
                 ([m.layers[i].mlp.down_proj for m in fused],
                  [np.asarray(m.layers[i].mlp.down_proj.kernel[...]) for m in unfused]))
        for linears, w in pairs:
            x = rng.standard_normal((2, 3, w[0].shape[0])).astype(np.float32)
            got = psum_over_devices(linears, x)
            want = x[0] @ w[0] + x[1] @ w[1]  # the unfused products, summed over the devices
            np.testing.assert_allclose(got, np.stack([want, want]), rtol=1e-5, atol=1e-5, err_msg=str(i))


def test_shards_reassemble_the_parameter():
    """Mamba2's fused in_proj, cut per device, holds each device's z, x, B, C, dt columns
    (Mamba1's its xs and z columns)."""
    from hybrid_jax.config import LayerSpec, Mamba2Config, ModelConfig

    m = Mamba2Config(num_heads=4, head_dim=2, state_size=3, n_groups=1)
    cfg = ModelConfig(architecture="t", vocab_size=8, hidden_size=4, layers=(LayerSpec("mamba2"),),
                      mamba2=m)
    cols = np.arange(m.d_inner * 2 + 2 * 3 + 4)[None, :]  # z 0-7 | x 8-15 | B 16-18 | C 19-21 | dt 22-25
    names = ("layers", 0, "mamba", "in_proj", "kernel")
    got = [tp.shard_param(names, cols, cfg, 2, d)[0].tolist() for d in (0, 1)]
    assert got[0] == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23]
    assert got[1] == [4, 5, 6, 7, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 24, 25]
    # Mamba1's in_proj [xs | z]: each device's xs channels, then the same channels of z.
    from hybrid_jax.config import Mamba1Config

    m1 = dataclasses.replace(cfg, layers=(LayerSpec("mamba1"),), mamba2=None,
                             mamba1=Mamba1Config(d_inner=4, state_size=2, dt_rank=1))
    names = ("layers", 0, "mamba1", "in_proj", "kernel")
    got = [tp.shard_param(names, np.arange(8)[None, :], m1, 2, d)[0].tolist() for d in (0, 1)]
    assert got == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with speculative_method='draft'"):
        EngineConfig(tensor_parallel_size=2, speculative_method="draft", speculative_model="x")
    EngineConfig(tensor_parallel_size=2, speculative_method="ngram")  # n-gram and MTP: sharded
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 devices.*1 cpu"):
        tp.make_mesh(2)
    cfg = load_preset("recurrentgemma-2b")  # 10 heads, 1 KV head
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 cannot split the 10 attention heads"):
        tp.check_shardable(cfg, 4)
    cfg = load_preset("mistral-7b")  # 32 heads, 8 KV heads: on 16 devices a KV head is on 2
    tp.check_shardable(cfg, 16)
    odd = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, num_heads=24,
                                                                 num_kv_heads=3))
    with pytest.raises(ValueError, match="tensor_parallel_size=8 cannot split the 3 attention KV heads"):
        tp.check_shardable(odd, 8)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 cannot split the 8192 Mamba1 channels"):
        tp.check_shardable(load_preset("falcon-mamba-7b"), 3)


def test_cli_refuses_more_devices_than_present_before_loading(capsys):
    from serving.entrypoints.cli import main

    assert main(["generate", "--model", "native-tiny", "--tensor-parallel-size", "2", "x"]) == 2
    err = capsys.readouterr().err
    assert "tensor_parallel_size=2 needs 2 devices" in err and "lower --tensor-parallel-size" in err
    assert "loading model" not in err


def test_pool_plan_is_per_device():
    """Pages and slots of one device's shard: half the KV heads and SSM heads at N = 2."""
    from serving.engine.engine_config import plan_pools

    cfg = load_preset("native-1b-parallel")  # 4 KV heads, 32 SSM heads, 1 group
    one, two = (plan_pools(cfg, EngineConfig(max_model_len=4096, tensor_parallel_size=n),
                           free_bytes=8 << 30, weight_bytes=0, dtype="bfloat16") for n in (1, 2))
    assert two.page_bytes == tuple(b // 2 for b in one.page_bytes)
    from serving.sample.penalties import init_token_stats

    stats = sum(x.size * x.dtype.itemsize  # penalty statistics stay whole (replicated)
                for x in jax.tree.leaves(jax.eval_shape(lambda: init_token_stats(1, cfg.vocab_size))))
    conv_bc = 3 * 2 * cfg.mamba2.state_size * 2 * cfg.num_layers  # B, C conv state: replicated
    assert two.slot_bytes - stats - conv_bc == (one.slot_bytes - stats - conv_bc) // 2
    with pytest.raises(ValueError, match=r"per device \(tensor_parallel_size=2\).*tensor_parallel_size"):
        plan_pools(cfg, EngineConfig(max_model_len=4096, tensor_parallel_size=2), free_bytes=1 << 20,
                   weight_bytes=0, dtype="bfloat16")
