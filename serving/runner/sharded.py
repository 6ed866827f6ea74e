"""Tensor-parallel placement of a runner's device state: parameters, caches, checkpoints.

Each device's parameter shard (hybrid_jax/tp_rules.py's rules) is built and
packed on the host (one flat buffer per dtype, serving/runner/packing.py) and put on
that device only; the per-device buffers form one array split along the mesh. With
fused projections each device's local model is fused, never the global one (a fused
matrix's column shards would mix heads). Caches, the state checkpoint pool and the MTP
head's K/V are created sharded by KV head / channel (`local_shapes`: one device's
shapes, which the one-device path allocates whole). The ModelRunner calls
`local_shapes` and `place_sharded` and keeps what they return; this module knows
nothing of buckets, compilation or dispatch.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hybrid_jax import tensor_parallel as tp
from hybrid_jax.cache import init_caches, states_of
from hybrid_jax.config import ModelConfig
from hybrid_jax.fusion import fuse_projections, kernel_stacks
from hybrid_jax.model import CausalLM
from hybrid_jax.mtp_ragged import mtp_group, mtp_init_caches
from serving.runner.packing import PackLayout, pack_host, plan_layout
from serving.runner.step_fns import Shardings


class Placement(NamedTuple):
    """What the runner holds after a tensor-parallel placement."""

    graphdef: nnx.GraphDef  # one device's local model (fused if `transposed`)
    layout: PackLayout  # the packed buffers' layout, the same on every device
    transposed: bool  # the local model's Linears are held [out, in] (fused)
    params: tuple[jax.Array, ...]  # one array per packed buffer, split along the mesh
    caches: object
    ckpts: object  # None: no checkpoint pool
    mtp_caches: object  # None: no MTP head
    mtp_shardings: object
    shardings: Shardings


def local_shapes(cfg: ModelConfig, n: int, *, num_pages: tuple[int, ...], page_size: int,
                 num_slots: int, dtype, state_dtype, kv_dtype, num_checkpoints: int | None,
                 mtp: bool) -> tuple:
    """One device's cache, checkpoint-pool and MTP-head K/V shapes on a mesh of n devices
    (its local heads and channels; n = 1: the whole model's) -> (caches, checkpoints or
    None, MTP K/V or None). `num_checkpoints` None: no checkpoint pool."""
    local = tp.local_config(cfg, n)
    cache_shapes = jax.eval_shape(lambda: init_caches(
        local, num_pages=num_pages, page_size=page_size, num_slots=num_slots, dtype=dtype,
        state_dtype=state_dtype, kv_dtype=kv_dtype))
    ckpt_shapes = jax.eval_shape(lambda: states_of(init_caches(
        local, num_pages=(1,) * len(num_pages), page_size=page_size,
        num_slots=max(num_checkpoints, 1), dtype=dtype, state_dtype=state_dtype))) \
        if num_checkpoints is not None else None
    mtp_shapes = jax.eval_shape(lambda: mtp_init_caches(
        local, num_pages=num_pages[mtp_group(cfg)], page_size=page_size,
        dtype=dtype)) if mtp else None
    return cache_shapes, ckpt_shapes, mtp_shapes


def place_sharded(model: CausalLM, mesh: Mesh, cache_shapes, ckpt_shapes, mtp_shapes=None, *,
                  fuse: bool) -> Placement:
    """Tensor parallelism: each device's parameter shard, packed on the host and put on
    that device only; caches, checkpoints and the MTP head's K/V created sharded (by
    head / channel). `fuse`: fuse each device's local model (`fuse_local`)."""
    cfg, n = model.cfg, mesh.size
    tp.check_weights_shardable(model, n)
    fp8 = tp.fp8_layout(model)  # FP8 kernels and their block scales split together
    local = tp.local_abstract_model(cfg, n, model.dtype, fp8)
    local_graph, local_state = nnx.split(local)
    state = nnx.state(model)
    graphdef, layout, transposed = local_graph, plan_layout(local_state), False
    per_device = []
    for d, dev in enumerate(mesh.devices.flat):
        leaves = tp.shard_params(cfg, state, n, d, local_state, fp8)
        if fuse:
            graphdef, layout, leaves = fuse_local(local_graph, local_state, leaves)
            transposed = True
        bufs = pack_host(layout, leaves)
        per_device.append([jax.device_put(b, dev) for b in bufs])
        del leaves, bufs
    split = NamedSharding(mesh, PartitionSpec(tp.AXIS))
    params = tuple(
        jax.make_array_from_single_device_arrays((n * size,), split, [bufs[i] for bufs in per_device])
        for i, size in enumerate(layout.sizes))
    caches = sharded_zeros(cache_shapes, mesh)
    ckpts = sharded_zeros(ckpt_shapes, mesh) if ckpt_shapes is not None else None
    mtp_caches = sharded_zeros(mtp_shapes, mesh) if mtp_shapes is not None else None
    return Placement(graphdef, layout, transposed, params, caches, ckpts, mtp_caches,
                     _sharding(mtp_caches), Shardings(mesh, split, _sharding(caches), _sharding(ckpts)))


def sharded_zeros(shapes, mesh: Mesh):
    """Zeros of the global shapes of `shapes` (one device's), split along each leaf's
    head / channel axis (`tp.cache_axes`)."""
    n = mesh.size
    axes = tp.cache_axes(shapes)

    def one(x, axis):
        shape = tuple(s * n if i == axis else s for i, s in enumerate(x.shape))
        spec = PartitionSpec(*([None] * axis), tp.AXIS)
        return jnp.zeros(shape, x.dtype, device=NamedSharding(mesh, spec))
    return jax.tree.map(one, shapes, axes)


def _sharding(tree):
    return None if tree is None else jax.tree.map(lambda x: x.sharding, tree)


def fuse_local(local_graph, local_state, leaves: list[np.ndarray]
               ) -> tuple[nnx.GraphDef, PackLayout, list[np.ndarray]]:
    """One device's local model fused as the single-device path fuses the whole model
    (hybrid_jax/fusion.py: fused input / output projections, transposed kernels, the
    stacks the decode kernels read in place), built on the host -> the fused graphdef
    and layout (the same for every device) and the fused leaves."""
    with jax.default_device(tp.host_device()):
        shard = nnx.merge(local_graph, jax.tree.unflatten(jax.tree.structure(local_state), leaves))
        fused = fuse_projections(shard)
        graphdef, fused_state = nnx.split(fused)
        stacks = kernel_stacks(fused)
        layout = plan_layout(fused_state, own=lambda x: tuple(x.shape) in stacks)
        return graphdef, layout, [np.asarray(x) for x in jax.tree.leaves(fused_state)]
