"""Tensor parallelism by heads (Megatron style) over a 1-D mesh axis of N devices.

Every device runs the same *local* model: `local_config(cfg, n)` is the model with
1/N of the heads, channels and vocabulary, and `shard_params` cuts each device's
parameters out of the global ones (the per-parameter rules and the FP8 block-alignment
checks live in hybrid_jax/tp_rules.py; this module re-exports them). The serving step
runs the local model under `shard_map`, so every kernel (paged attention, SSD, conv,
scans) sees only its device's heads; the few sums that cross devices are JAX
collectives on the mesh axis, placed by marking layers of the local model
(`mark_local_model`):

| what | split | across devices |
|---|---|---|
| attention q | column-parallel by head | - |
| attention k, v, KV pages | by KV head; a KV head is replicated on N/K devices when K < N | - |
| o_proj, MLP down, Mamba2/1 out_proj, RG-LRU linear_out, short-conv out | row-parallel | psum, then bias |
| MLP gate/up (fused or not) | column-parallel; a fused [gate, up] matrix is cut per part | - |
| MoE experts' gate/up, down | each expert by its width f (gate/up per part) | psum of the routed sum |
| FP8 experts' block scales | with their blocks (a device's width share is whole blocks) | - |
| MoE shared expert | as the MLP | psum (its down_proj) |
| MoE router, expert bias, shared-expert gate | replicated | - |
| Mamba2 in_proj | per part: z, x, dt by head; B, C by group (replicated when G < N) | - |
| Mamba2 conv weights and conv state | by channel (x by head, B/C by group) | - |
| Mamba2 A, D, dt_bias, SSM state | by head | - |
| Mamba2 gated norm | by head; a group spread over devices | all_gather of its sums of squares |
| Mamba1 in_proj (xs, z halves), conv, dt_proj out, dt_bias, A_log, D, states | by channel (d_inner) | - |
| Mamba1 x_proj (d_inner -> dt, B, C) | row-parallel | psum (dt, B, C whole on every device) |
| Mamba1 dt/B/C norms (Jamba's weights) | replicated, after the psum | - |
| RG-LRU (linears, conv, gates, state) | by channel block (head) | - |
| Gated DeltaNet q, k (projection, conv, conv state) | by key head | - |
| Gated DeltaNet v, z, b, a, A_log, dt_bias, delta-rule state | by value head (those of the key heads) | - |
| Qwen3-Next's grouped in_proj_qkvz / in_proj_ba | by key-head group | - |
| gated attention's q_proj (query and gate per head) | by head, with its gate | - |
| KDA q/k/v_proj, conv, f_b_proj, dt_bias, g_b_proj, b_proj, A_log, states | by head | - |
| KDA low-rank f_a_proj, g_a_proj; output norm | replicated | - |
| MLA q_proj / q_b_proj, kv_b_proj (k_nope and v per head: W_uk / W_uv absorbed per device) | by head | - |
| MLA latent pages (one row per token that every head reads) | a copy per device on axis 0 | - |
| MLA latent projections q_a_proj, kv_a_proj_with_mqa (+ their norms) | replicated | - |
| embeddings, LM head | by vocabulary (replicated when V % N != 0) | psum / all_gather of logits |
| norms, q/k norms, shared-block adapters' down LoRAs | replicated | - |

A device's shard of a fused matrix is itself laid out as the local model expects
([z | x B C | dt] of the local heads), so the local model's code is the model's code.
This module knows nothing of serving: it maps configs, the local model and cache shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from hybrid_jax.config import LayerKind, ModelConfig
from hybrid_jax.tp_rules import (  # noqa: F401  (the parameter rules, re-exported: tp.shard_params, ...)
    MOE_SCALES,
    ROW_PARALLEL,
    Fp8Layout,
    _names,
    _units,
    check_weights_shardable,
    dequantize_unaligned,
    fp8_layout,
    shard_param,
    shard_params,
    shard_shape,
    unaligned_fp8_linears,
    vocab_split,
)

AXIS = "tp"


def _divides(n: int, count: int, replicable: bool) -> bool:
    return count % n == 0 or (replicable and n % count == 0)


def check_shardable(cfg: ModelConfig, n: int) -> None:
    """ValueError naming `tensor_parallel_size` and the dimension that cannot be split."""
    if n < 1:
        raise ValueError(f"tensor_parallel_size={n} must be >= 1")
    if n == 1:
        return
    dims: list[tuple[str, int, bool]] = []  # (what, count, may replicate when count < n)
    kinds = {s.kind for s in cfg.layers}
    if cfg.attention is not None and any(k.has_attention for k in kinds):
        a = cfg.attention
        dims += [("attention heads (num_heads)", a.num_heads, False),
                 ("attention KV heads (num_kv_heads)", a.num_kv_heads, True)]
    if cfg.mamba2 is not None and any(k.has_mamba2 for k in kinds):
        dims += [("SSM heads (mamba2.num_heads)", cfg.mamba2.num_heads, False),
                 ("SSM groups (mamba2.n_groups)", cfg.mamba2.n_groups, True)]
    if cfg.mamba1 is not None and LayerKind.MAMBA1 in kinds:
        dims.append(("Mamba1 channels (mamba1.d_inner)", cfg.mamba1.d_inner, False))
    if cfg.rglru is not None and LayerKind.RGLRU in kinds:
        dims.append(("RG-LRU heads (rglru.num_heads)", cfg.rglru.num_heads, False))
    if cfg.short_conv is not None and LayerKind.SHORT_CONV in kinds:
        dims.append(("short-conv channels (hidden_size)", cfg.hidden_size, False))
    if cfg.gated_deltanet is not None and LayerKind.GATED_DELTANET in kinds:
        # Value head i reads key head i // (hv / hk): splitting the key heads splits both.
        dims.append(("Gated DeltaNet key heads (gated_deltanet.num_k_heads)",
                     cfg.gated_deltanet.num_k_heads, False))
    if cfg.mlp is not None:
        dims.append(("MLP intermediate size (mlp.intermediate_size)", cfg.mlp.intermediate_size, False))
    if cfg.shared_block is not None and LayerKind.SHARED_BLOCK in kinds:
        dims.append(("shared-block MLP intermediate size", cfg.shared_block.intermediate_size, False))
    if cfg.moe is not None:
        dims.append(("MoE expert width (moe.intermediate_size)", cfg.moe.intermediate_size, False))
        if cfg.moe.shared_expert is not None:
            dims.append(("MoE shared-expert width (moe.shared_expert.intermediate_size)",
                         cfg.moe.shared_expert.intermediate_size, False))
    for what, count, replicable in dims:
        if not _divides(n, count, replicable):
            also = " (or be a divisor of it: replicated)" if replicable else ""
            raise ValueError(f"tensor_parallel_size={n} cannot split the {count} {what}: it must "
                             f"divide them{also}; choose a tensor_parallel_size that does")
    # With heads divisible by n and n by the KV heads (groups), a device's heads share one
    # KV head (SSM group): heads per KV head = (heads per device) * (n / KV heads).


def _local(count: int, n: int) -> int:
    return max(count // n, 1)


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one of n devices runs: its share of heads, channels and vocabulary."""
    check_shardable(cfg, n)
    if n == 1:
        return cfg
    subs: dict[str, object] = {}
    if cfg.attention is not None:
        a = cfg.attention
        subs["attention"] = dataclasses.replace(a, num_heads=a.num_heads // n,
                                                num_kv_heads=_local(a.num_kv_heads, n))
    if cfg.mla is not None:  # MLA: its query heads (the latent pages are whole on every device)
        subs["mla"] = dataclasses.replace(cfg.mla, num_heads=cfg.mla.num_heads // n)
    if cfg.mamba2 is not None:
        m = cfg.mamba2
        subs["mamba2"] = dataclasses.replace(m, num_heads=_local(m.num_heads, n),
                                             n_groups=_local(m.n_groups, n))
    if cfg.mamba1 is not None:
        subs["mamba1"] = dataclasses.replace(cfg.mamba1, d_inner=cfg.mamba1.d_inner // n)
    if cfg.rglru is not None:
        r = cfg.rglru
        subs["rglru"] = dataclasses.replace(r, width=r.width // n, num_heads=_local(r.num_heads, n))
    if cfg.short_conv is not None:
        subs["short_conv"] = dataclasses.replace(cfg.short_conv, channels=cfg.hidden_size // n)
    if cfg.gated_deltanet is not None:
        g = cfg.gated_deltanet
        subs["gated_deltanet"] = dataclasses.replace(g, num_k_heads=_local(g.num_k_heads, n),
                                                     num_v_heads=_local(g.num_v_heads, n))
    if cfg.mlp is not None:
        subs["mlp"] = dataclasses.replace(cfg.mlp, intermediate_size=_local(cfg.mlp.intermediate_size, n))
    if cfg.shared_block is not None:
        sb = cfg.shared_block
        subs["shared_block"] = dataclasses.replace(sb, intermediate_size=sb.intermediate_size // n)
    if cfg.moe is not None:
        moe, shared = cfg.moe, cfg.moe.shared_expert
        if shared is not None:
            shared = dataclasses.replace(shared, intermediate_size=shared.intermediate_size // n)
        subs["moe"] = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // n,
                                          shared_expert=shared)
    if vocab_split(cfg, n):
        subs["vocab_size"] = cfg.vocab_size // n
        subs["eos_token_ids"] = ()  # ids of the global vocabulary
    return dataclasses.replace(cfg, **subs)


def mark_local_model(model: nnx.Module, cfg: ModelConfig, n: int) -> nnx.Module:
    """Set the collectives of a local model (built from `local_config`) on `AXIS`."""
    from hybrid_jax.layers.linear import Embed, Linear
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.layers.norms import GatedRMSNorm

    g = cfg.mamba2.n_groups if cfg.mamba2 is not None else 1
    for path, mod in nnx.iter_graph(model):
        if isinstance(mod, Linear) and path and (path[-1] in ROW_PARALLEL
                                                 or tuple(path[-2:]) == ("mamba1", "x_proj")):
            mod.reduce_axis = AXIS
        elif isinstance(mod, Linear) and path and path[-1] == "lm_head" and vocab_split(cfg, n):
            mod.gather_axis = AXIS
        elif isinstance(mod, Embed) and vocab_split(cfg, n):
            mod.shard_axis = AXIS
        elif isinstance(mod, GatedRMSNorm) and g < n:
            mod.axis, mod.group_devices = AXIS, n // g
        elif isinstance(mod, MoE):
            mod.reduce_axis = AXIS
    return model


def local_abstract_model(cfg: ModelConfig, n: int, dtype, fp8: Fp8Layout | None = None) -> nnx.Module:
    """The marked local model with abstract (shape-only) parameters; the Linears and expert
    stacks named in `fp8` (`fp8_layout` of the global model) hold FP8 weights and their
    block scales."""
    from hybrid_jax.layers.fp8 import FP8, scale_shape
    from hybrid_jax.layers.linear import Linear
    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.model import CausalLM
    from pallas_kernels.grouped_gemm import scale_blocks

    local = local_config(cfg, n)
    model = nnx.eval_shape(lambda: CausalLM(local, dtype=dtype, rngs=nnx.Rngs(0)))
    for path, m in nnx.iter_graph(model):
        if isinstance(m, MoE):
            for name in MoE.STACKS:
                if (key := ".".join(map(str, (*path, name)))) in (fp8 or {}):
                    block, scale_dtype = fp8[key]
                    e, k, nw = shape = tuple(getattr(m, name).value.shape)
                    m.set_fp8(name, jax.ShapeDtypeStruct(shape, FP8), jax.ShapeDtypeStruct(
                        (e, *scale_blocks(k, nw, block, name == "gate_up")), scale_dtype), block)
        if isinstance(m, Linear) and (key := ".".join(map(str, path))) in (fp8 or {}):
            block, scale_dtype = fp8[key]
            shape = tuple(m.kernel.value.shape)
            m.set_fp8(jax.ShapeDtypeStruct(shape, FP8),
                      jax.ShapeDtypeStruct(scale_shape(shape, block), scale_dtype), block)
    return mark_local_model(model, cfg, n)


# -- caches ---------------------------------------------------------------------------------

def cache_axes(caches) -> object:
    """Per cache leaf: the axis split over devices (KV pages by KV head, states by head/channel;
    the stacks of hybrid_jax/cache.py: K/V [k, n, P, s, e], states [n, S, ...])."""
    from hybrid_jax.cache import GDNState, KVCache, Mamba1State, Mamba2State, RGLRUState, ShortConvState

    def axes(c):
        if isinstance(c, KVCache):  # FP8 pages' scales [k, n] split with their KV heads
            return KVCache(0, 0) if c.k_scale is None else KVCache(0, 0, 0, 0)
        if isinstance(c, GDNState):
            return GDNState(3, 2)
        if isinstance(c, Mamba2State):
            return Mamba2State(3, 2)
        if isinstance(c, Mamba1State):  # conv [n, S, k-1, c], ssm [n, S, c, N]: by channel
            return Mamba1State(3, 2)
        if isinstance(c, RGLRUState):
            return RGLRUState(3, 2)
        if isinstance(c, ShortConvState):
            return ShortConvState(3)
        return None

    is_leaf = lambda c: isinstance(c, KVCache | Mamba2State | Mamba1State | RGLRUState | ShortConvState
                                   | GDNState)
    return jax.tree.map(axes, caches, is_leaf=is_leaf)


def shard_kv_scales(cfg: ModelConfig, scales: tuple[tuple[np.ndarray, np.ndarray], ...], n: int
                    ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """FP8 KV scales of the whole model (hybrid_jax/kv_quant.py: per window group (k_scale,
    v_scale), each [k, n_g]) -> the global arrays of the sharded caches: device d's share of
    the KV heads (the heads its K/V pages hold, replicated when k < n) stacked in device
    order along axis 0, [n * k_local, n_g], as `cache_axes` splits them."""
    k = cfg.attention.num_kv_heads
    return tuple(tuple(np.concatenate([_units(np.asarray(x), 0, k, n, d) for d in range(n)])
                       for x in pair) for pair in scales)


# -- devices ---------------------------------------------------------------------------------

def make_mesh(n: int, offset: int = 0):
    """A 1-D mesh over local devices [offset, offset + n) (a data-parallel replica's group);
    ValueError naming the setting if the host has too few."""
    from jax.sharding import Mesh

    if n < 1:
        raise ValueError(f"tensor_parallel_size={n} must be >= 1")
    if offset < 0:
        raise ValueError(f"device_offset={offset} must be >= 0")
    devices = jax.local_devices()
    if n > len(devices):
        raise ValueError(f"tensor_parallel_size={n} needs {n} devices, but this host has "
                         f"{len(devices)} {devices[0].platform} device(s) (more hosts, see "
                         "docs/tensor_parallel.md): lower tensor_parallel_size")
    if offset + n > len(devices):
        raise ValueError(f"device_offset={offset} with tensor_parallel_size={n} needs devices "
                         f"{offset}..{offset + n - 1}, but this host has {len(devices)} "
                         f"{devices[0].platform} device(s): lower device_offset")
    return Mesh(np.asarray(devices[offset:offset + n]), (AXIS,))


def host_device():
    """Where to load a model that will be sharded: the host, never one accelerator whole."""
    return jax.devices("cpu")[0]


def param_bytes_per_device(cfg: ModelConfig, n: int, dtype, fp8: Fp8Layout | None = None) -> int:
    """Parameter bytes one device holds with tensor_parallel_size=n (exact shard shapes)."""
    local = local_abstract_model(cfg, n, dtype, fp8)
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(local)))
