"""The tensor-parallel checks, run in a child process that sees 4 CPU devices.

`tests/serving/test_tensor_parallel.py` starts this script with
XLA_FLAGS=--xla_force_host_platform_device_count=4 (the pytest process has already
initialised JAX with one device) and reads the JSON it prints: one entry per check,
"ok" or the failure. Engines are expensive to compile on a CPU, so one child runs every
check and each engine serves several workloads.

Models: three tiny configurations that together hold every layer kind and every
sharding rule of the architectures the engine serves (native / Falcon-H1 / Mamba2 /
Bamba / Granite / Nemotron-H / Qwen3-Next / Falcon-Mamba; RecurrentGemma / Gemma 3 / LFM2 /
Mistral / Qwen3.5 / Jamba; Zamba2), with
head counts that force replication at 4 devices (MQA, n_groups=1, vocabulary 130).
The reference is the same engine at tensor_parallel_size=1, whose code path does not
shard anything.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import traceback

import jax
from flax import nnx
from jax import monitoring

from hybrid_jax.config import (
    AttentionConfig,
    GatedDeltaNetConfig,
    LayerSpec,
    Mamba1Config,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
    MoEConfig,
    RGLRUConfig,
    SharedBlockConfig,
    ShortConvConfig,
)
from hybrid_jax.loading import LoadedModel
from hybrid_jax.model import CausalLM
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams

NEW = 8
MARGIN = 2e-3  # compare greedy tokens while the reference's top-1/top-2 logprob gap exceeds this
LOGPROB_TOL = 2e-3
PROMPT_LENS = (3, 21, 30, 9, 17)
COMPILES: list[str] = []
monitoring.register_event_duration_secs_listener(
    lambda name, *_a, **_k: COMPILES.append(name) if "backend_compile" in name else None)


def L(kind: str, window: int | None = None, moe: bool = False) -> LayerSpec:
    return LayerSpec(kind, window, moe)


def models() -> dict[str, ModelConfig]:
    """Tiny configurations; comments say which architectures' features each one carries."""
    # Falcon-H1 / native / Mamba2 / Bamba / Nemotron-H / Granite: parallel hybrid layer, muP
    # multipliers, MQA (1 KV head: replicated on 2 and 4 devices), n_groups=1 (the gated
    # norm's group spread over devices), an MLP-only layer, tied embeddings (vocab split).
    # Qwen3-Next: a Gated DeltaNet layer with grouped projections (4 key heads of 8, 8 value
    # heads; its conv and delta-rule states also checkpointed by the prefix cache).
    # Falcon-Mamba: a Mamba1 layer whose dt, B, C are RMS-normalised without weights (after
    # x_proj's psum over the channels), its states checkpointed too.
    ssm = ModelConfig(
        architecture="tp-test-ssm", vocab_size=128, hidden_size=64,
        layers=(L("hybrid", 16), L("attention"), L("mlp"), L("gated_deltanet"), L("mamba1")),
        attention=AttentionConfig(num_heads=4, num_kv_heads=1, head_dim=16, key_multiplier=0.8),
        mamba2=Mamba2Config(num_heads=8, head_dim=16, state_size=16, n_groups=1, chunk_size=16,
                            in_proj_multipliers=(1.1, 0.9, 1.2, 0.8, 1.05)),
        mlp=MLPConfig(intermediate_size=96, gate_multiplier=1.2, down_multiplier=0.9),
        gated_deltanet=GatedDeltaNetConfig(num_k_heads=4, num_v_heads=8, head_k_dim=8, head_v_dim=8,
                                           grouped_projections=True),
        mamba1=Mamba1Config(d_inner=64, state_size=16, dt_rank=8, bcdt_norm="unweighted"),
        tie_embeddings=True, residual_in_fp32=True, attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1, ssm_out_multiplier=0.8, norm_eps=1e-5)
    # RecurrentGemma / Gemma 3 / LFM2 / Mistral: RG-LRU, q/k norms, soft-caps, partial
    # rotary, biases, sandwich (1 + w) norms, short conv, a fused gate/up MLP, GQA (2 KV
    # heads: split on 2, replicated on 4), a Mamba2 layer with 4 groups (split), an untied
    # head over 130 tokens (split on 2 devices, replicated on 4), two window groups;
    # Granite-4.0-H / LFM2-MoE: a mixture of experts (softmax top-2 of 4 gated experts, each
    # split by its width) with a fused gate/up shared expert; Qwen3.5: gated attention (q_proj's
    # per-head sigmoid output gate) and a Gated DeltaNet layer (projections apart, 4 key heads
    # of 16, 8 value heads of 8). Jamba: a Mamba1 layer with weighted dt/B/C norms (replicated)
    # and in/out projection biases, its channel sub-block the mixture of experts.
    rec = ModelConfig(
        architecture="tp-test-recurrent", vocab_size=130, hidden_size=64,
        layers=(L("rglru"), L("attention", 16), L("short_conv"), L("mamba2", moe=True),
                L("attention"), L("gated_deltanet"), L("mamba1", moe=True)),
        attention=AttentionConfig(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=8,
                                  qkv_bias=True, o_bias=True, softcap=50.0, qk_norm=True,
                                  output_gate=True),
        gated_deltanet=GatedDeltaNetConfig(num_k_heads=4, num_v_heads=8, head_k_dim=16, head_v_dim=8),
        mamba1=Mamba1Config(d_inner=128, state_size=8, dt_rank=4, bcdt_norm="weighted", proj_bias=True),
        rglru=RGLRUConfig(width=64, num_heads=4),
        short_conv=ShortConvConfig(conv_kernel=3, bias=True),
        mamba2=Mamba2Config(num_heads=8, head_dim=8, state_size=16, n_groups=4, chunk_size=16,
                            norm_before_gate=True, in_proj_bias=True, out_proj_bias=True),
        mlp=MLPConfig(intermediate_size=96, activation="gelu_tanh", bias=True, fused_gate_up=True),
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32,
                      shared_expert=MLPConfig(intermediate_size=48, fused_gate_up=True)),
        norm_offset=True, sandwich_norm=True, logits_softcap=30.0, embedding_scale=8.0)
    # Zamba2 (+ Nemotron-H's squared-ReLU MLP and MoE layers): shared attention + MLP blocks
    # with LoRA adapters on q/k/v and gate/up, Mamba2 with 2 groups (replicated on 4
    # devices); an MoE layer of non-gated experts (sigmoid, expert bias, 2 of 3 groups,
    # scaling) with a non-gated shared expert.
    shared = ModelConfig(
        architecture="tp-test-shared", vocab_size=128, hidden_size=64,
        layers=(L("shared_block"), L("mamba2"), L("mlp"), L("shared_block"), L("mlp", moe=True)),
        attention=AttentionConfig(num_heads=4, num_kv_heads=4, head_dim=32),
        mamba2=Mamba2Config(num_heads=8, head_dim=16, state_size=16, n_groups=2, chunk_size=16),
        shared_block=SharedBlockConfig(num_blocks=2, intermediate_size=96, adapter_rank=8,
                                       attention_adapters=True),
        mlp=MLPConfig(intermediate_size=96, activation="relu2", gated=False),
        moe=MoEConfig(num_experts=6, top_k=2, intermediate_size=32, activation="relu2",
                      gated=False, scores="sigmoid", norm_eps=1e-20, expert_bias=True,
                      routed_scaling=1.5, n_group=3, topk_group=2,
                      shared_expert=MLPConfig(intermediate_size=48, activation="relu2",
                                              gated=False)),
        separate_mlp_layers=True)
    return {"ssm": ssm, "recurrent": rec, "shared": shared}


def extra_models() -> dict[str, ModelConfig]:
    """Run only when named on the command line (CI time: ~100 s of compilation each on 2
    cores): `python tests/serving/tensor_parallel_child.py kimi` with 4 host devices.
    Kimi Linear: KDA layers (per-channel decay, low-rank gates replicated), MLA with a
    q LoRA (latents replicated, q_b / kv_b by head, K wider than V), a dense first layer
    then sigmoid-routed grouped MoE with a shared expert."""
    from hybrid_jax.checkpoints.kimi_linear import config_from_hf

    kimi = config_from_hf({
        "architectures": ["KimiLinearForCausalLM"], "vocab_size": 128, "hidden_size": 64,
        "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "num_experts": 8,
        "num_experts_per_token": 2, "num_expert_group": 2, "topk_group": 1, "num_shared_experts": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
        "linear_attn_config": {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4,
                               "full_attn_layers": [2, 4]}})
    return {"kimi": kimi}


_MODELS: dict[str, CausalLM] = {}


def engine(cfg: ModelConfig, n: int, **kw) -> LLMEngine:
    model = _MODELS.get(cfg.architecture)  # one random model per config, shared by its engines
    if model is None:
        model = _MODELS[cfg.architecture] = CausalLM(cfg, rngs=nnx.Rngs(0))
    settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                    page_size=8, seq_buckets=(4,), token_buckets=(32,), tensor_parallel_size=n,
                    compilation_cache_dir=None) | kw
    return LLMEngine(LoadedModel(model, cfg, None, "test"), EngineConfig(**settings),
                     show_progress=False)


def prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(1)
    return [rng.integers(0, vocab, n).tolist() for n in PROMPT_LENS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=2)
SEEDED = [SamplingParams(temperature=0.8, top_k=20, seed=7 + i, max_tokens=NEW, ignore_eos=True,
                         logit_bias={5: 3.0, 11: -100.0} if i == 1 else None)  # one row biased
          for i in range(len(PROMPT_LENS) + 1)]


def run(eng: LLMEngine, ps: list[list[int]], params) -> list:
    return LLM.from_engine(eng).generate(prompt_token_ids=ps, sampling_params=params)


def compare(ref, out, what: str) -> int:
    """Greedy tokens equal while the reference's margin is clear; logprobs close. -> compared."""
    compared = 0
    for r, o in zip(ref, out, strict=True):
        for i, (rt, ot, rl, ol) in enumerate(zip(r.token_ids, o.token_ids, r.logprobs, o.logprobs,
                                                 strict=True)):
            top = sorted(rl.values(), reverse=True)
            if top[0] - top[1] <= MARGIN:
                break  # a near tie: the two runs may rightly part here
            assert rt == ot, f"{what}: token {i} of request {r.request_id}: {ot} != reference {rt}"
            assert abs(rl[rt] - ol[ot]) < LOGPROB_TOL, (
                f"{what}: logprob {ol[ot]} != reference {rl[rt]} at token {i}")
            compared += 1
    return compared


def compare_enough(ref, out, what: str):
    compared = compare(ref, out, what)
    return compared >= len(ref) * NEW // 2 or f"only {compared} tokens compared"


# The ssm model's engines also cache prefixes (checkpoint pool split like the state slots):
# its last prompt repeats 24 tokens of the 30-token one, so its solo run resumes from them.
SETTINGS = {"ssm": dict(enable_prefix_caching=True, prefix_state_stride=16),
            "kimi": dict(enable_prefix_caching=True, prefix_state_stride=16)}


# Engines at tp=2 only (CI time: with Gated DeltaNet, FP8 and the MoE kernel the child's
# tp=2 and tp=4 runs took over 15 minutes on 2 cores). tp=4 (replicated KV heads, groups
# and head) is checked for shapes by test_every_preset_shards_to_its_local_shapes and
# its refusals below; TP_SIZES = (2, 4) runs the engines there too.
TP_SIZES = (2,)


def check_model(name: str, cfg: ModelConfig, results: dict) -> None:
    ps = prompts(cfg.vocab_size)
    kw = SETTINGS.get(name, {})
    if kw:
        ps.append(ps[2][:24] + ps[0])
    ref_eng = engine(cfg, 1, **kw)
    ref = run(ref_eng, ps, GREEDY)
    ref_seeded = [o.token_ids for o in run(ref_eng, ps, SEEDED[:len(ps)])]
    del ref_eng
    distinct = {t for o in ref for t in o.token_ids}
    results[f"{name}: reference is not degenerate"] = len(distinct) > 3 or f"tokens {distinct}"
    for n in TP_SIZES:
        # A pool of 9 pages per group (8 tokens each) holds only some of the 5 sequences at
        # once (64-token sequences): the batch preempts; solo runs do not.
        eng = engine(cfg, n, num_pages=10, **kw)
        batch = run(eng, ps, GREEDY)
        key = f"{name}: tp={n}"
        results[f"{key} greedy == tp=1 (margin-aware, chunked prefill of 7)"] = \
            _check(compare_enough, ref, batch, key)
        results[f"{key} preempted in the batch"] = eng.stats()["num_preemptions"] > 0 or \
            f"stats {eng.stats()}"
        before = len(COMPILES)
        solo = [run(eng, [p], GREEDY)[0] for p in ps]
        results[f"{key} batched == solo"] = [o.token_ids for o in batch] == [o.token_ids for o in solo] \
            or "differ"
        seeded = [o.token_ids for o in run(eng, ps, SEEDED[:len(ps)])]
        results[f"{key} seeded sampling == tp=1"] = seeded == ref_seeded or f"{seeded} != {ref_seeded}"
        if kw:
            hits = eng.stats()["prefix_cache_hit_tokens"]
            results[f"{key} prefix cache hits"] = hits >= 16 or f"{hits} hit tokens"
        results[f"{key} compiles nothing while serving"] = len(COMPILES) == before or \
            f"{len(COMPILES) - before} compilations"
        results[f"{key} parameters are split"] = _check(_split_params, eng, cfg, n)


def _split_params(eng: LLMEngine, cfg: ModelConfig, n: int):
    r = eng.runner
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(
        nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0))))))
    per = r.param_bytes_per_device
    shards = {s.device for x in r.params for s in x.addressable_shards}
    assert len(shards) == n, shards
    return per < total or f"{per} bytes per device of {total}"


def _check(fn, *args):
    try:
        return fn(*args)
    except AssertionError as e:
        return str(e)


def check_fp8(results: dict) -> None:
    """FP8 weights and FP8 KV pages (the ssm model with 2 KV heads, quantized at load with
    4 x 4 blocks, so that every split of this tiny model is whole blocks; its K/V pages in
    e4m3 with per-head scales): greedy at tp=2 equals tp=1, both engines calibrate the same
    scales and each device's pages hold the scales of its own KV head, the shards hold FP8;
    with 16 x 16 blocks (which the Mamba2 in_proj's dt columns cut) the Linears that would
    split a block are held dense at tp=2 (startup.tp_aligned) and the engine serves
    the tp=1 16-block engine's tokens."""
    import numpy as np

    from hybrid_jax.quantization import quantize_model

    ssm = models()["ssm"]
    cfg = dataclasses.replace(ssm, attention=dataclasses.replace(ssm.attention, num_kv_heads=2))

    def fp8_engine(n: int, block: int) -> LLMEngine:
        model = quantize_model(CausalLM(cfg, rngs=nnx.Rngs(0)), "fp8", block=block)
        settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                        page_size=8, seq_buckets=(4,), token_buckets=(32,), tensor_parallel_size=n,
                        compilation_cache_dir=None, kv_cache_dtype="fp8")
        return LLMEngine(LoadedModel(model, cfg, None, "test"), EngineConfig(**settings), show_progress=False)

    ps = prompts(cfg.vocab_size)
    eng1 = fp8_engine(1, 4)
    ref = run(eng1, ps, GREEDY)
    eng = fp8_engine(2, 4)
    results["fp8: tp=2 greedy == tp=1 (margin-aware)"] = _check(compare_enough, ref, run(eng, ps, GREEDY),
                                                                "fp8")
    results["fp8: tp=2 KV pages are e4m3"] = eng.stats()["kv_cache_dtype"] == "float8_e4m3fn" or \
        f"{eng.stats()['kv_cache_dtype']}"

    def scales_split() -> bool | str:
        for one, two in zip(eng1.runner.caches.kv, eng.runner.caches.kv, strict=True):
            for a, b in ((one.k_scale, two.k_scale), (one.v_scale, two.v_scale)):
                a = np.asarray(a)  # [2 KV heads, layers]: distinct per head (calibrated)
                assert (a[0] != a[1]).any() and np.array_equal(np.asarray(b), a), (a, np.asarray(b))
                for shard in b.addressable_shards:  # device d serves query heads 2d, 2d + 1: KV head d
                    d = list(eng.runner.mesh.devices.flat).index(shard.device)
                    assert np.array_equal(np.asarray(shard.data), a[d:d + 1]), (d, shard.data, a)
        return True

    results["fp8: tp=2 KV scales == tp=1's, split by KV head"] = _check(scales_split)
    dtypes = eng.stats()["weight_bytes_by_dtype"]
    results["fp8: tp=2 shards hold FP8"] = dtypes.get("float8_e4m3fn", 0) > 0 or f"{dtypes}"
    e16 = fp8_engine(2, 16)
    dtypes = e16.stats()["weight_bytes_by_dtype"]
    mixed = dtypes.get("float8_e4m3fn", 0) > 0 and dtypes.get("float32", 0) > 0 or f"{dtypes}"
    ps16 = ps[:2]
    same = _check(compare_enough, run(fp8_engine(1, 16), ps16, GREEDY), run(e16, ps16, GREEDY), "fp8-16")
    results["fp8: 16-blocks at tp=2: unaligned Linears dense, tokens == tp=1"] = \
        same if mixed is True else mixed


def check_mtp(results: dict) -> None:
    """MTP speculation at tp=2 with prefix caching (verification, the state choice and the
    head's step per device shard) against plain greedy decoding at tp=1: the same tokens while the reference's
    margin is clear, with drafts verified and some accepted (a head built to agree)."""
    from tests.serving.mtp_helpers import agreeing_head, native_with_mtp

    lm = native_with_mtp()
    agreeing_head(lm, 0.1)
    ps = prompts(lm.config.vocab_size)
    ps.append(ps[2][:24] + ps[0])  # resumes from the 30-token prompt's cached prefix

    def eng(n: int, **kw) -> LLMEngine:
        settings = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                        page_size=8, seq_buckets=(4,), token_buckets=(32,), tensor_parallel_size=n,
                        compilation_cache_dir=None) | kw
        return LLMEngine(lm, EngineConfig(**settings), show_progress=False)

    ref = run(eng(1), ps, GREEDY)  # plain decoding; logprobs give the margins
    # the reference workload's settings: MTP k=2 with prefix caching (state checkpoints split too)
    e2 = eng(2, speculative_method="mtp", num_speculative_tokens=2, enable_prefix_caching=True,
             prefix_state_stride=16)
    out = run(e2, ps, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))  # verified

    def same() -> bool | str:
        compared = 0
        for r, o in zip(ref, out, strict=True):
            for i, (rt, ot, rl) in enumerate(zip(r.token_ids, o.token_ids, r.logprobs, strict=True)):
                top = sorted(rl.values(), reverse=True)
                if top[0] - top[1] <= MARGIN:
                    break
                if rt != ot:
                    return f"token {i} of request {r.request_id}: {ot} != reference {rt}"
                compared += 1
        return compared >= len(ref) * NEW // 2 or f"only {compared} tokens compared"

    results["mtp: tp=2 greedy == tp=1 plain (margin-aware)"] = same()
    st = e2.stats()
    results["mtp: tp=2 verified drafts, some accepted, prefix cache hits"] = (
        st["spec_verify_steps"] > 0 and st["spec_accepted_tokens"] > 0
        and st["prefix_cache_hit_tokens"] >= 16) or f"{st}"


def refusals(results: dict) -> None:
    cfg = models()["ssm"]
    for n, want in ((8, "devices"), (3, "attention heads")):
        try:
            engine(cfg, n)
            results[f"tensor_parallel_size={n} refused"] = "accepted"
        except ValueError as e:
            msg = str(e)
            results[f"tensor_parallel_size={n} refused"] = (
                "tensor_parallel_size" in msg and want in msg) or msg


def moe_kernel_on_shards(results: dict, n: int = 2) -> None:
    """The grouped GEMM kernel (interpret mode) on per-device expert shards under shard_map,
    as the local model runs it: experts split by width f (gate/up per half), the routed
    partial sums added by psum, against the dense reference on the whole experts."""
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from hybrid_jax.layers.moe import routed_experts, routed_reference

    rng = np.random.default_rng(0)
    t, d, e, f, k = 6, 32, 4, 64, 2
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(t)]), jnp.int32)
    weights = jnp.asarray(rng.random((t, k)), jnp.float32)
    gate_up = rng.standard_normal((e, d, 2 * f)).astype(np.float32) * d**-0.5
    down = rng.standard_normal((e, f, d)).astype(np.float32) * f**-0.5
    w = f // n  # each device: its slice of the gate columns, then of the up columns
    gu_local = np.stack([np.concatenate([gate_up[..., i * w:(i + 1) * w],
                                         gate_up[..., f + i * w:f + (i + 1) * w]], -1) for i in range(n)])
    dn_local = np.stack([down[:, i * w:(i + 1) * w] for i in range(n)])

    def local(x, weights, experts, gu, dn):
        y = routed_experts(x, weights, experts, gu[0], dn[0], activation="silu", gated=True,
                           impl="interpret")
        return jax.lax.psum(y, "x")

    mesh = Mesh(np.array(jax.devices()[:n]), ("x",))
    rep = P()
    # check_vma=False as the serving step's shard_map (serving/runner/step_fns.py).
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(rep, rep, rep, P("x"), P("x")),
                                out_specs=rep, check_vma=False))(x, weights, experts, jnp.asarray(gu_local),
                                                jnp.asarray(dn_local))
    want = routed_reference(x, weights, experts, jnp.asarray(gate_up), jnp.asarray(down),
                            activation="silu", gated=True)
    err = float(jnp.abs(got - want).max())
    results["moe kernel on device shards == dense"] = err < 1e-4 or f"max error {err}"

    # FP8 experts (16 x 16 blocks: each device's 32 columns per half are 2 whole blocks),
    # weights and scales split by tensor_parallel's rules, against the dense reference on
    # the whole FP8 stacks.
    from hybrid_jax import tensor_parallel as tp
    from hybrid_jax.layers.fp8 import quantize_stack

    qgu, sgu = (np.asarray(a) for a in quantize_stack(jnp.asarray(gate_up), 16, glu=True))
    qdn, sdn = (np.asarray(a) for a in quantize_stack(jnp.asarray(down), 16))
    cfg = models()["recurrent"]
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=f))
    layer = ("layers", 3, "moe")
    split = lambda name, a: jnp.asarray(np.stack([tp.shard_param((*layer, name), a, cfg, n, i)  # noqa: E731
                                                  for i in range(n)]))

    def local_fp8(x, weights, experts, gu, sg, dn, sd):
        y = routed_experts(x, weights, experts, gu[0], dn[0], activation="silu", gated=True,
                           impl="interpret", fp8=(sg[0], sd[0], 16))
        return jax.lax.psum(y, "x")

    got = jax.jit(jax.shard_map(local_fp8, mesh=mesh, in_specs=(rep, rep, rep) + (P("x"),) * 4,
                                out_specs=rep, check_vma=False))(
        x, weights, experts, split("gate_up", qgu), split("gate_up_scale", sgu), split("down", qdn),
        split("down_scale", sdn))
    want = routed_reference(x, weights, experts, jnp.asarray(qgu), jnp.asarray(qdn), activation="silu",
                            gated=True, fp8=(jnp.asarray(sgu), jnp.asarray(sdn), 16))
    err = float(jnp.abs(got - want).max())
    results["fp8 moe kernel on device shards == dense"] = err < 1e-4 or f"max error {err}"


def main() -> None:
    assert len(jax.devices()) == 4, jax.devices()
    results: dict[str, object] = {}
    only = sys.argv[1:]
    try:
        refusals(results)
        if not only or "moe_kernel" in only:
            moe_kernel_on_shards(results)
        for name, cfg in (models() | (extra_models() if only else {})).items():
            if not only or name in only:
                check_model(name, cfg, results)
        if not only or "fp8" in only:
            check_fp8(results)
        if not only or "mtp" in only:
            check_mtp(results)
    except Exception:  # report, then fail the test that reads it
        results["child crashed"] = traceback.format_exc()
    print("RESULTS " + json.dumps({k: (v if v is True else str(v)) for k, v in results.items()}))


if __name__ == "__main__":
    main()
