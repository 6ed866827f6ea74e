"""Serving-time fusion of projections that read the same input: one GEMM instead of several.

A decode step's projections are skinny GEMMs whose cost is streaming their weights, and
cuBLAS streams one wide matrix at a higher share of HBM bandwidth than several narrow
ones. On the H100 (docs/history/benchmarks-2026.md, third pass; native-1b-parallel's 24 layers, 2.9
GB of bf16 weights, 2026-11-24) the GEMMs of a step took 1.69 / 1.71 / 1.82 / 2.08 ms at
8 / 64 / 128 / 256 rows as nine per layer and 1.20 / 1.27 / 1.43 / 1.55 ms fused into
four (58 -> 81% of the copy-bandwidth floor at 8 rows, 57 -> 77% at 64).

`fuse_projections(model)` returns a model whose layers hold:

- `Block.fused_in`: the projections of the layer's temporal mixers, which all read the
  normed input, concatenated by columns: q, k, v (attention) then in_proj (Mamba2).
  Fused when a layer has at least two of them (attention alone qualifies), no RG-LRU or
  short conv, no shared-block adapters, and equal input multipliers (one input).
  Missing biases are zeros (adding 0 is exact).
- `Block.fused_out`: o_proj and out_proj of a layer with attention and Mamba2 whose
  outputs are summed with multipliers 1 and no output biases, stacked by rows:
  [o | y] @ [[W_o], [W_out]] gives o @ W_o + y @ W_out with one rounding instead of two.
- a gated MLP's gate_proj and up_proj as its `gate_up_proj` (gate first), the fused form
  GatedMLP already has (Granite's checkpoints store it so).
- the Mamba2 layers' A_log, D, dt_bias, conv weight and bias stacked into one array each,
  shared by the layers (`Mamba2Mixer.stack_row`): the decode kernels read their row in
  place instead of XLA copying each layer's slices before the custom calls.

- the layers' RMS norms (input and MLP norms together, and the Mamba2 gated norms) with
  their weights stacked into one array per kind (`RMSNorm.stack_row`), which the decode
  step's norm kernels read in place (pallas_kernels/decode_glue.py).

- a bf16 MoE layer's f32 router also as its three bf16 terms (`MoE.router_split`,
  layers/moe.router_terms), so the step's exact-f32 routing GEMM does not split it anew.

- every plain Linear of the layers (the fused ones and the rest, e.g. down_proj) with
  its kernel transposed, [out, in] (`Linear.transposed`): as fast for cuBLAS at 8-128
  rows, and at one row XLA's reduction over each kernel row streams the weights at
  95-102% of copy bandwidth against cuBLAS's 67-90% (hybrid_jax/layers/linear.py).

The mixers' other parameters are untouched; q/k/v, in_proj, o_proj and out_proj become
None in the layers that were fused. Only the serving path (hybrid_jax/ragged.py) runs a
fused model: `Block.__call__` (the full-sequence reference) refuses one. Outputs equal the
unfused model's up to the rounding of the accumulation order (the fused GEMMs compute
the same dot products). The argument model is not changed; the returned one shares its
unfused parameter arrays. FP8 Linears (hybrid_jax/layers/fp8.py) fuse only with FP8
Linears of the same block size whose concatenated dimension is a multiple of it (their
scales then concatenate block for block); otherwise they stay apart, transposed with
their scales.

Tensor parallelism fuses each device's local model (hybrid_jax/tensor_parallel.py), never
the global one: a column split of a fused global matrix would mix the projections' shards,
while the concatenation of a device's own shards is exactly the local model's fused matrix.
Column-parallel projections fuse as above; row-parallel o_proj and out_proj (marked with
`reduce_axis`) fuse into one row-parallel `fused_out`, whose single psum replaces theirs;
the down-projections are transposed and keep their psum.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers import linear
from hybrid_jax.layers.attention import Attention
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.moe import MoE, router_terms
from hybrid_jax.model import Block, CausalLM
from pallas_kernels.stream_gemm import load_runtime


def linear_from(kernel_t: jnp.ndarray, bias: jnp.ndarray | None, *, dtype: jnp.dtype | None = None,
                scale_t: jnp.ndarray | None = None, block: int | None = None) -> Linear:
    """A Linear holding these arrays, its kernel (and FP8 block scales) given transposed
    ([out, in]; no random initialisation of the full shape); `dtype`: the compute dtype
    (default the kernel's)."""
    lin = Linear(1, 1, bias=bias is not None, dtype=dtype or kernel_t.dtype, rngs=nnx.Rngs(0))
    lin.kernel = nnx.Param(kernel_t)
    lin.bias = None if bias is None else nnx.Param(bias)
    if scale_t is not None:
        lin.scale, lin.block = nnx.Param(scale_t), block
    lin.transposed = True
    return lin


def _plain(lin: Linear) -> bool:
    return lin.reduce_axis is None and lin.gather_axis is None


def _local(lin: Linear) -> bool:
    """A Linear whose product is per device: plain, or row-parallel (its partial product is
    summed over `reduce_axis` after it, whatever the kernel's layout)."""
    return lin.gather_axis is None


def _kernel_t(lin: Linear) -> jnp.ndarray:
    return lin.kernel[...] if lin.transposed else lin.kernel[...].T


def _scale_t(lin: Linear) -> jnp.ndarray:
    return lin.scale[...] if lin.transposed else lin.scale[...].T


def _storage(lin: Linear) -> tuple:
    """What must agree for Linears to share one kernel: dtypes, FP8 block and scale dtype."""
    scale = None if lin.scale is None else jnp.dtype(lin.scale.dtype)
    return jnp.dtype(lin.kernel.dtype), lin.dtype, lin.block, scale


def _concatenable(linears: list[Linear], axis: int) -> bool:
    """Same storage; FP8 kernels also block-aligned along the concatenated dimension (axis
    1: outputs, 0: inputs), all but the last (the last one's edge block stays an edge)."""
    if len({_storage(lin) for lin in linears}) != 1:
        return False
    first = linears[0]
    if first.scale is None:
        return True
    return all(_kernel_t(lin).shape[1 - axis] % first.block == 0 for lin in linears[:-1])


def _out_features(lin: Linear) -> int:
    return lin.kernel.shape[0 if lin.transposed else 1]


def _concat(linears: list[Linear], axis: int) -> Linear:
    """Linears concatenated by output columns (axis 1: shared input) or input rows (axis 0:
    summed outputs; biases must then be absent), held transposed."""
    assert _concatenable(linears, axis)
    first = linears[0]
    assert len({lin.reduce_axis for lin in linears}) == 1 and (axis == 0 or first.reduce_axis is None)
    kernel_t = jnp.concatenate([_kernel_t(lin) for lin in linears], axis=1 - axis)
    quant = {} if first.scale is None else dict(
        scale_t=jnp.concatenate([_scale_t(lin) for lin in linears], axis=1 - axis), block=first.block)
    if all(lin.bias is None for lin in linears):
        fused = linear_from(kernel_t, None, dtype=first.dtype, **quant)
        fused.reduce_axis = first.reduce_axis  # row-parallel parts: one psum of the summed products
        return fused
    assert axis == 1
    bias = jnp.concatenate([lin.bias[...] if lin.bias is not None
                            else jnp.zeros(_out_features(lin), first.dtype) for lin in linears])
    return linear_from(kernel_t, bias, dtype=first.dtype, **quant)


def _transpose_rest(block: Block) -> None:
    """Every per-device Linear of the block not yet transposed (the fused ones are) held
    [out, in]; row-parallel ones too (the psum follows the product)."""
    for _, node in nnx.iter_graph(block):
        if isinstance(node, Linear) and _local(node) and not node.transposed:
            node.kernel = nnx.Param(node.kernel[...].T)
            if node.scale is not None:
                node.scale = nnx.Param(node.scale[...].T)
            node.transposed = True


def input_projections(block: Block) -> list[Linear] | None:
    """The projections `fused_in` would concatenate, in its column order (None: not fusable)."""
    cfg = block.cfg
    if (block.temporal_norm is None or block.depth is not None or block.recurrent is not None
            or block.conv is not None):
        return None
    parts: list[Linear] = []
    if block.attention is not None:
        a = block.attention
        if not isinstance(a, Attention):  # MLA (Kimi Linear): its own projections, not fused
            return None
        parts += [a.q_proj, a.k_proj, a.v_proj]
    if block.mamba is not None:
        if block.attention is not None and cfg.attention_in_multiplier != cfg.ssm_in_multiplier:
            return None
        parts.append(block.mamba.in_proj)
    if len(parts) < 2 or not _concatenable(parts, 1) or not all(_plain(p) for p in parts):
        return None
    return parts


def output_projections(block: Block) -> list[Linear] | None:
    """[o_proj, out_proj] when `fused_out` applies (see the module doc), else None."""
    cfg = block.cfg
    if block.attention is None or block.mamba is None:
        return None
    if cfg.attention_out_multiplier != 1.0 or cfg.ssm_out_multiplier != 1.0:
        return None
    parts = [block.attention.o_proj, block.mamba.out_proj]
    # Row-parallel parts (tensor parallelism) fuse when both sum over the same axis: one
    # all-reduce of the summed product instead of one per branch.
    if any(p.bias is not None or not _local(p) for p in parts):
        return None
    if parts[0].reduce_axis != parts[1].reduce_axis:
        return None
    return parts if _concatenable(parts, 0) else None


def fuse_projections(model: CausalLM) -> CausalLM:
    """A copy of `model` (sharing its arrays) with its projections fused (module doc)."""
    graphdef, state = nnx.split(model)
    fused = nnx.merge(graphdef, state)
    for block in fused.layers:
        outs = output_projections(block)
        ins = input_projections(block)
        if ins is not None:
            block.fused_in = nnx.data(_concat(ins, axis=1))
            if block.attention is not None:
                block.attention.q_proj = block.attention.k_proj = block.attention.v_proj = None
            if block.mamba is not None:
                block.mamba.in_proj = None
        if outs is not None:
            block.fused_out = nnx.data(_concat(outs, axis=0))
            block.attention.o_proj = None
            block.mamba.out_proj = None
        mlp = block.mlp
        if (mlp is not None and mlp.gate_up_proj is None and mlp.gate_proj is not None
                and _plain(mlp.gate_proj) and _plain(mlp.up_proj)
                and (mlp.gate_proj.bias is None) == (mlp.up_proj.bias is None)
                and _concatenable([mlp.gate_proj, mlp.up_proj], 1)):
            mlp.gate_up_proj = nnx.data(_concat([mlp.gate_proj, mlp.up_proj], axis=1))
            mlp.gate_proj = mlp.up_proj = None
        _transpose_rest(block)
        moe = block.moe
        if moe is not None and moe.dtype == jnp.bfloat16:  # the router's bf16 terms, once
            moe.router_split = nnx.data(nnx.Param(router_terms(moe.router[...])))
    # Small per-layer parameters that decode kernels take as one stack, read at each
    # layer's row in place (`stack_row`): a per-layer slice of the step's packed
    # parameters is copied before every custom call (a buffer of its own).
    if linear.stream_gemm_active():  # decode's gate/up + silu * up read their layer's rows of one stack
        _stack_linears([b.mlp.gate_up_proj for b in fused.layers if _streams_glu(b.mlp)])
    # Mosaic GPU's runtime, before any stored executable holding stream_glu or the FP8
    # decode kernel (pallas_kernels/fp8_stream.py, also with the stream GEMM off) is loaded.
    load_runtime()
    mixers = [b.mamba for b in fused.layers if b.mamba is not None]
    _stack(mixers, MAMBA_STACKED)  # conv1d_decode, ssm_decode_packed
    # decode_glue.add_rms_norm (input and MLP norms in one stack) and mixer_merge
    _stack([n for b in fused.layers for n in (b.temporal_norm, b.mlp_norm) if n is not None], ("weight",),
           lambda n: (n.eps, n.offset))
    _stack([m.norm for m in mixers if m.norm is not None], ("weight",),
           lambda n: (n.eps, n.n_groups, n.norm_before_gate, n.group_devices))
    return fused


MAMBA_STACKED = ("A_log", "D", "dt_bias", "conv_weight", "conv_bias")


def _stack(modules: list, names: tuple[str, ...], settings=lambda m: ()) -> None:
    """Each of the parameters `names` of these modules as one array [len(modules), ...]
    shared by them, each module reading its row (`module.stack_row`); a parameter absent
    (None) in all of them is skipped. Modules that differ (a parameter's presence, shape,
    dtype, or `settings(module)`) keep their own arrays: checked before anything is set.
    Native-1b-parallel's Mamba2 parameters alone were five copies per layer and step (120)."""
    if len(modules) < 2 or any(m.stack_row is not None for m in modules):
        return
    if len({(type(m), settings(m)) for m in modules}) != 1:
        return
    present = []
    for name in names:
        values = [getattr(m, name) for m in modules]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values) or len({(v.shape, jnp.dtype(v.dtype)) for v in values}) != 1:
            return
        present.append(name)
    for name in present:
        stack = nnx.Param(jnp.stack([getattr(m, name)[...] for m in modules]))
        for m in modules:
            setattr(m, name, stack)
    for i, m in enumerate(modules):
        m.stack_row = i


def _streams_glu(mlp) -> bool:
    """Whether this MLP's decode steps can take `Linear.glu` (silu, a bias-free fused
    gate/up kernel whose shape the stream GEMM takes at some decode row count)."""
    lin = None if mlp is None else mlp.gate_up_proj
    if lin is None or not mlp.silu or lin.bias is not None or not lin.transposed or lin.quantized:
        return False
    n2, k = lin.kernel.shape
    return n2 % 2 == 0 and linear.glu_config(64, n2 // 2, k) is not None


def _stack_linears(linears: list[Linear]) -> None:
    """These transposed Linears' kernels as stacks [L, o, i], one per kernel shape and dtype
    with at least two members, shared by them, each reading its row (`Linear.stack_row`):
    the decode step's stream GEMM (pallas_kernels/stream_gemm.py) reads a layer's rows of
    the stack in place, where a per-layer slice of the packed parameters would be copied
    before the custom call (XLA's own GEMMs read their row of the stack as they read a
    slice of the packed parameters, without a copy). Biases stay per layer."""
    groups: dict[tuple, list[Linear]] = {}
    for lin in linears:
        if lin.transposed and lin.stack_row is None and not lin.quantized:
            groups.setdefault((lin.kernel.shape, jnp.dtype(lin.kernel.dtype)), []).append(lin)
    for group in groups.values():
        if len(group) < 2:
            continue
        stack = nnx.Param(jnp.stack([lin.kernel[...] for lin in group]))
        for i, lin in enumerate(group):
            lin.kernel = stack
            lin.stack_row = i


def kernel_stacks(model: CausalLM) -> set[tuple[int, ...]]:
    """The shapes of the arrays a Pallas kernel reads whole: the Linears' kernel stacks
    (`_stack_linears`; the stream GEMM) and the MoE layers' expert stacks and, for FP8
    stacks, their block scales (the grouped GEMM reads each touched expert in place). The
    serving runner gives each its own parameter buffer: a slice of a shared buffer passed
    to a kernel is copied out first, on every step (granite-4.0-h-tiny on an H100: its
    batch-1 step went from 11.1 to 3.2 ms when its 80 expert stacks got buffers of their
    own; docs/benchmarks.md)."""
    shapes = {tuple(lin.kernel[...].shape) for _, lin in nnx.iter_graph(model)
              if isinstance(lin, Linear) and lin.stack_row is not None}
    return shapes | {tuple(x.shape) for x in _expert_arrays(model)}


def _expert_arrays(model: CausalLM) -> list:
    """Every MoE layer's expert stacks, and an FP8 layer's block scales beside them."""
    out = []
    for _, m in nnx.iter_graph(model):
        if isinstance(m, MoE):
            names = [n for n in MoE.STACKS if getattr(m, n) is not None]
            names += [f"{n}_scale" for n in names if getattr(m, f"{n}_scale") is not None]
            out += [getattr(m, n)[...] for n in names]
    return out


def shared_stack_bytes(model: CausalLM, device) -> int:
    """Bytes of the expert stacks (and scales) already on `device`: fusion leaves them as
    they are and the runner's packing takes each as its own buffer without copying it
    (serving/runner/packing.py), so they are held once; every other parameter is copied
    into the packed buffers while the loaded model still holds it."""
    return sum(x.nbytes for x in _expert_arrays(model) if x.devices() == {device})


def is_fused(model: CausalLM) -> bool:
    return any(b.fused_in is not None or b.fused_out is not None for b in model.layers)
