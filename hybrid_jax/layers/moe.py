"""Mixture of experts: a router, routed experts stored as stacked tensors, a shared expert.

Shapes: t tokens, d hidden, e experts, k experts per token, f expert width.

    route(x)    logits = x @ router (f32) -> scores (softmax | sigmoid) -> top-k of
                scores + expert_bias (within the best groups) -> weights [t, k], experts [t, k]
    experts     y_t = sum_j w_tj * expert_{e_tj}(x_t), expert(x) = act(x @ G_e) * (x @ U_e) @ D_e
    shared      y_t += shared_expert(x_t) (* sigmoid(x_t @ w) with a shared-expert gate)

The experts' weights are three stacks read in place: `gate_up` [e, d, 2f] (gate columns
first; `up` [e, d, f] for non-gated experts) and `down` [e, f, d]. The routed product
sorts the t*k (token, expert) assignments by expert and runs one grouped GEMM per
projection over the ragged groups (pallas_kernels/grouped_gemm.py: a Pallas kernel on the
GPU, `jax.lax.ragged_dot` as its reference; the activation fused into the gate/up pass):
every assignment's rows meet only their own expert's weights, and an expert no token chose
is never read. `routed_reference` is the same sum written densely
(every expert on every token, weighted by a dense [t, e] combine matrix), an independent
check of the sorting and grouping.

The stacks may be FP8 (`MoE.set_fp8`: float8_e4m3fn with one scale per B x B block of
each expert, gate and up halves on their own block grids; pallas_kernels/grouped_gemm.py):
an FP8 checkpoint's per-expert Linears and `quantization="fp8"` keep them so in device
memory, and the grouped GEMM reads them in place; the products run in the compute dtype.
The router and the shared-expert gate stay unquantized (an FP8 checkpoint's are
dequantized at load: [d, e] and [d, 1], a fraction of a percent of the layer's bytes).

MoE is token-wise, so the full-sequence forward and the engine's ragged serving path
are the same call. Tensor parallelism (hybrid_jax/tensor_parallel.py) splits every
expert by its width f (gate/up by columns, down by rows): a device's routed output is a
partial sum, added over the mesh axis `reduce_axis`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.config import MoEConfig
from hybrid_jax.layers.fp8 import quantize_experts
from hybrid_jax.layers.mlp import ACTIVATIONS, GatedMLP
from pallas_kernels.backend import Impl, resolve_impl
from pallas_kernels.grouped_gemm import (
    FEW_ROWS,
    FP8,
    GroupedConfig,
    assignment_table,
    dequantize_stack,
    grouped_matmul,
    moe_config,
    scale_blocks,
    work_table,
)

F32 = jnp.float32


_ROUTING_TAPS: list[list[np.ndarray]] = []  # `record_routing`'s open records


@contextlib.contextmanager
def record_routing() -> Iterator[list[np.ndarray]]:
    """Record the experts every `route` call chooses while this block is open: one [t, k]
    int array per call, appended in call order (a model's MoE layers in depth order), from
    functions traced inside such a block (a compiled function traced outside one, such as
    the engine's executables, carries no callback). For benchmarks that count the experts
    a batch really touches (the decode floor)."""
    rec: list[np.ndarray] = []
    _ROUTING_TAPS.append(rec)
    try:
        yield rec
    finally:
        _ROUTING_TAPS.remove(rec)


def _tap(experts) -> None:
    if _ROUTING_TAPS:
        _ROUTING_TAPS[-1].append(np.asarray(experts))


def router_terms(router: jax.Array) -> jax.Array:
    """The f32 router [d, e] as three bf16 terms side by side [d, 3e]: hi + mid + lo holds
    its 24-bit significand exactly (`router_logits`). Computed once when the serving copy
    is built (hybrid_jax/fusion.py), not in every step."""
    r = router.astype(F32)
    hi = r.astype(jnp.bfloat16)
    rest = r - hi.astype(F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(F32)).astype(jnp.bfloat16)
    return jnp.concatenate([hi, mid, lo], axis=1)


def router_logits(x: jax.Array, router: jax.Array, terms: jax.Array | None = None) -> jax.Array:
    """x [t, d] @ router [d, e] -> [t, e] f32 logits, to f32 precision: a TF32 logit can flip
    a near-tie between two experts. For bf16 x, the f32 router is split into three bf16
    terms (`router_terms`; `terms` if given, else split here) and one bf16 GEMM with f32
    accumulation takes all three: every product exact, as the f32 GEMM's, on tensor cores
    (an f32 GEMM at 64 tokens ran on CUDA cores: 55 us a layer on an H100, granite-4.0-h-tiny)."""
    if x.dtype != jnp.bfloat16:
        return jnp.dot(x.astype(F32), router.astype(F32), precision=jax.lax.Precision.HIGHEST)
    e = router.shape[1]
    out = jnp.dot(x, router_terms(router) if terms is None else terms, preferred_element_type=F32)
    return (out[:, :e] + out[:, e:2 * e]) + out[:, 2 * e:]


def route(x: jax.Array, router: jax.Array, bias: jax.Array | None,
          cfg: MoEConfig, terms: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """x [t, d] -> (weights [t, k] f32, experts [t, k] int32); see `MoEConfig`. `terms`:
    the router's bf16 terms (`router_terms`), when the serving copy holds them."""
    logits = router_logits(x, router, terms)
    scores = jax.nn.softmax(logits, axis=-1) if cfg.scores == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias.astype(F32)
    if cfg.n_group > 1:  # keep the topk_group groups with the best sum of their two best scores
        t, e = choice.shape
        grouped = choice.reshape(t, cfg.n_group, e // cfg.n_group)
        group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        best = jax.lax.top_k(group_score, cfg.topk_group)[1]
        keep = jnp.any(best[..., None] == jnp.arange(cfg.n_group), axis=1)  # [t, groups]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(t, e)
    experts = jax.lax.top_k(choice, cfg.top_k)[1]
    if cfg.scores == "softmax" and cfg.norm_topk:  # renormalised softmax = softmax of the chosen
        weights = jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if cfg.norm_topk:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + cfg.norm_eps)
    if cfg.routed_scaling != 1.0:
        weights = weights * cfg.routed_scaling
    if _ROUTING_TAPS:  # traced inside record_routing: report to the record open at run time
        jax.debug.callback(_tap, experts, ordered=True)
    return weights, experts.astype(jnp.int32)


def _hidden(h: jax.Array, act, gated: bool) -> jax.Array:  # the dense reference's
    if not gated:
        return act(h)
    gate, up = jnp.split(h, 2, axis=-1)
    return act(gate) * up


Fp8Scales = tuple[jax.Array, jax.Array, int]  # (gate_up / up scales, down scales, block)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                   down: jax.Array, *, activation: str, gated: bool,
                   impl: Impl | None = None, cfg: GroupedConfig | None = None,
                   fp8: Fp8Scales | None = None) -> jax.Array:
    """sum_j w_tj * expert_{e_tj}(x_t) -> [t, d] f32, by grouped GEMMs over the assignments
    sorted by expert. x [t, d], weights/experts [t, k], gate_up [e, d, w], down [e, f, d];
    FP8 stacks come with `fp8` (their block scales and block; products in x's dtype).

    `impl` picks the grouped GEMM (pallas_kernels/backend.py): the Pallas kernel
    (pallas_kernels/grouped_gemm.py; its tiles chosen by the row count t*k: decode tiles
    stream each touched expert's weights once; `cfg` overrides them) or its
    `jax.lax.ragged_dot` reference."""
    t, k = experts.shape
    e = gate_up.shape[0]
    flat = experts.reshape(t * k)
    impl = resolve_impl(impl)
    cfg = cfg or moe_config(t * k, fp8=fp8 is not None)
    s1, s2, block = fp8 or (None, None, None)
    dtype = x.dtype if fp8 else down.dtype
    if impl != "reference" and t * k <= min(cfg.bm, FEW_ROWS):
        # Few assignments (decode at batch 1 or 2): each one an item of its own in (token, j)
        # order, so no argsort, group sizes or work table (5 small kernels a layer): rows are
        # gathered from token r // k and stored in place.
        table, sizes = assignment_table(flat), None
        src, dst = jnp.asarray(np.arange(t * k, dtype=np.int32) // k), None  # a literal
    else:
        order = jnp.argsort(flat, stable=True)  # assignment rows grouped by expert
        sizes = jnp.sum(flat[:, None] == jnp.arange(e), axis=0, dtype=jnp.int32)  # one fusion
        table = None if impl == "reference" else work_table(sizes, t * k, cfg.bm)  # both passes
        src, dst = (order // k).astype(jnp.int32), order.astype(jnp.int32)
    # Gate/up and the activation in one pass, rows gathered from x by token (src);
    # down stores each sorted row back at its assignment (dst): y [t*k, d] in (token, j) order.
    h = grouped_matmul(x, gate_up, sizes, src=src, glu=gated,
                       act=ACTIVATIONS[activation], out_dtype=dtype, cfg=cfg, table=table,
                       impl=impl, scale=s1, block=block)
    y = grouped_matmul(h, down, sizes, dst=dst, out_dtype=dtype, cfg=cfg,
                       table=table, impl=impl, scale=s2, block=block).reshape(t, k, -1)
    return jnp.einsum("tkd,tk->td", y.astype(F32), weights.astype(F32))


def routed_reference(x: jax.Array, weights: jax.Array, experts: jax.Array, gate_up: jax.Array,
                     down: jax.Array, *, activation: str, gated: bool,
                     fp8: Fp8Scales | None = None) -> jax.Array:
    """`routed_experts` written densely: every expert on every token, weighted by the
    combine matrix c [t, e] (c_te = w_tj where e_tj = e, else 0). Same shapes and result
    (FP8 stacks dequantized to x's dtype first)."""
    if fp8 is not None:
        s1, s2, block = fp8
        gate_up = dequantize_stack(gate_up, s1, block, gated, x.dtype)
        down = dequantize_stack(down, s2, block, False, x.dtype)
    e = gate_up.shape[0]
    combine = jnp.einsum("tk,tke->te", weights.astype(F32), jax.nn.one_hot(experts, e, dtype=F32))
    h = jnp.einsum("td,edw->tew", x.astype(gate_up.dtype), gate_up)
    y = jnp.einsum("tef,efd->ted", _hidden(h, ACTIVATIONS[activation], gated).astype(down.dtype),
                   down)
    return jnp.einsum("ted,te->td", y.astype(F32), combine)


class MoE(nnx.Module):
    """x [..., d] -> [..., d]: routed experts plus the optional shared expert (module doc)."""

    def __init__(self, dim: int, cfg: MoEConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs,
                 fp8_block: int | None = None):
        """`fp8_block`: each expert stack quantized to FP8 with this block (`set_fp8`,
        layers/fp8.quantize_experts) right after it is drawn, so only one stack is ever held
        in `dtype` (quantization="fp8" of a preset's random weights: the same draws and the
        same values as quantizing the drawn model, without the whole bf16 model's memory)."""
        e, f = cfg.num_experts, cfg.intermediate_size
        normal = lambda shape, fan_in, dt: nnx.Param(
            fan_in**-0.5 * jax.random.normal(rngs.params(), shape, dt))
        # FP8 stacks (`set_fp8`): their block scales [e, ceil(in/B), nb] and the block B.
        self.gate_up_scale: nnx.Param | None = nnx.data(None)
        self.up_scale: nnx.Param | None = nnx.data(None)
        self.down_scale: nnx.Param | None = nnx.data(None)
        self.block: int | None = None
        # Whether the stacks were quantized as drawn (not an FP8 checkpoint's own choice:
        # hybrid_jax/quantization.py still quantizes such a model's Linears).
        self.fp8_at_draw = fp8_block is not None
        # The router and expert bias stay f32 whatever the dtype (Nemotron-H keeps them so).
        self.router = normal((dim, e), dim, F32)
        # The serving copy's router as three bf16 terms [dim, 3e] (`router_terms`, set by
        # hybrid_jax/fusion.py for bf16 compute): the split paid once, not per step.
        self.router_split: nnx.Param | None = nnx.data(None)
        self.expert_bias = nnx.Param(jnp.zeros((e,), F32)) if cfg.expert_bias else None
        first = ("gate_up", (e, dim, 2 * f), dim) if cfg.gated else ("up", (e, dim, f), dim)
        setattr(self, "up" if cfg.gated else "gate_up", None)
        for name, shape, fan_in in (first, ("down", (e, f, dim), f)):
            w = fan_in**-0.5 * jax.random.normal(rngs.params(), shape, dtype)
            setattr(self, name, nnx.Param(w))
            if fp8_block is not None:
                kernel, scale = quantize_experts(w, fp8_block, glu=name == "gate_up")
                del w  # the stack in `dtype` freed before the next is drawn
                self.set_fp8(name, kernel, scale, fp8_block)
        self.shared_expert = (None if cfg.shared_expert is None else
                              GatedMLP(dim, cfg.shared_expert, dtype=dtype, rngs=rngs))
        self.shared_gate = normal((dim, 1), dim, dtype) if cfg.shared_expert_gate else None
        self.reduce_axis: str | None = None  # tensor parallel: routed partial sums added over it
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)  # the compute dtype (FP8 stacks' products run in it)

    STACKS = ("gate_up", "up", "down")

    @property
    def quantized(self) -> bool:
        return self.block is not None

    def set_fp8(self, name: str, kernel: jax.Array, scale: jax.Array, block: int) -> None:
        """Hold the stack `name` ("gate_up", "up" or "down") in FP8: kernel [e, in, out]
        float8_e4m3fn and its block scales (module doc; gate_up's halves apart). Every
        stack of the layer must be FP8 with one block (`quantized`)."""
        e, k, nw = kernel.shape
        want = (e, *scale_blocks(k, nw, block, name == "gate_up"))
        if name not in self.STACKS or getattr(self, name) is None:
            raise ValueError(f"set_fp8: {name=} is not a stack of this MoE layer")
        if jnp.dtype(kernel.dtype) != FP8 or tuple(scale.shape) != want or self.block not in (None, block):
            raise ValueError(f"FP8 stack {name} needs float8_e4m3fn and scales {want} in one block "
                             f"({self.block or block}), got {kernel.dtype} {kernel.shape}, scales "
                             f"{scale.shape}, block {block}")
        setattr(self, name, nnx.Param(kernel))
        setattr(self, f"{name}_scale", nnx.Param(scale))
        self.block = block

    def routed(self, x, weights, experts, **kw) -> jax.Array:
        """The routed sum (`routed_experts`) over this layer's stacks, FP8 or not."""
        first, name = (self.gate_up, "gate_up") if self.gate_up is not None else (self.up, "up")
        fp8 = None
        if self.quantized:
            if getattr(self, f"{name}_scale") is None or self.down_scale is None:
                raise ValueError("an FP8 MoE layer needs every expert stack in FP8 (set_fp8)")
            fp8 = (getattr(self, f"{name}_scale")[...], self.down_scale[...], self.block)
        return routed_experts(x, weights, experts, first[...], self.down[...], activation=self.cfg.activation,
                              gated=self.cfg.gated, fp8=fp8, **kw)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        bias = None if self.expert_bias is None else self.expert_bias[...]
        terms = None if self.router_split is None else self.router_split[...]
        return route(x, self.router[...], bias, self.cfg, terms)

    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        y = self.routed(x.astype(self.dtype) if self.quantized else x, weights, experts)
        if self.reduce_axis is not None:
            y = jax.lax.psum(y, self.reduce_axis)
        y = y.astype(x.dtype)
        if self.shared_expert is not None:
            s = self.shared_expert(x)
            if self.shared_gate is not None:
                gate = jnp.dot(x.astype(F32), self.shared_gate[...].astype(F32))
                s = (s.astype(F32) * jax.nn.sigmoid(gate)).astype(s.dtype)
            y = y + s.astype(y.dtype)
        return y.reshape(shape)
