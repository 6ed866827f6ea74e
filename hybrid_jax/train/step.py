"""The jitted train and eval steps over the full-sequence forward of a CausalLM.

Parameters are a plain nested dict (`nnx.to_pure_dict`) of f32 master weights. The
forward runs in `compute_dtype`: each parameter is cast to the dtype that a model
built in that dtype would hold (bf16 weights; the SSM's A_log, D and dt_bias stay
f32) and merged into that model's graph, so gradients flow back into f32.

One optimizer step = `grad_accum` micro-steps (a `lax.scan` summing gradients), then
optax AdamW (warmup + cosine decay, global-norm clipping). With several devices the
micro-batch is sharded over a 1-D `data` mesh and parameters are replicated; XLA
inserts the gradient all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hybrid_jax.config import ModelConfig
from hybrid_jax.model import CausalLM
from hybrid_jax.train.config import TrainConfig

Params = dict


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """f32 master weights of a fresh model for training, as a pure dict.

    The module defaults suit random-weight tests, not training; here: embeddings with
    std d**-0.5 (tied logits start near unit scale), residual output projections scaled
    by (2 x layers)**-0.5 (GPT-2), and Mamba2's dt_bias so that softplus(dt_bias) is
    log-uniform in [1e-3, 1e-1] (Mamba's init).
    """
    _, state = nnx.split(CausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed)))
    params = nnx.to_pure_dict(state)
    key = jax.random.key(seed + 1)
    emb = params["embed"]["embedding"]
    params["embed"]["embedding"] = jax.random.normal(key, emb.shape) * cfg.hidden_size**-0.5
    out_scale = (2 * cfg.num_layers) ** -0.5
    for i, layer in params["layers"].items():
        for mixer, proj in (("attention", "o_proj"), ("mamba", "out_proj"), ("mlp", "down_proj")):
            if layer.get(mixer) and proj in layer[mixer]:
                layer[mixer][proj]["kernel"] = layer[mixer][proj]["kernel"] * out_scale
        if layer.get("mamba"):
            u = jax.random.uniform(jax.random.fold_in(key, i), layer["mamba"]["dt_bias"].shape)
            dt = jnp.exp(u * (jnp.log(0.1) - jnp.log(1e-3)) + jnp.log(1e-3))
            layer["mamba"]["dt_bias"] = dt + jnp.log(-jnp.expm1(-dt))
    return params


def param_count(params: Params) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def schedule(tc: TrainConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup_steps, tc.steps,
                                              end_value=tc.lr * tc.min_lr_ratio)


def optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW; no decay on vectors (norm weights, biases, SSM A/D/dt)."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(tc.clip_norm),
                       optax.adamw(schedule(tc), b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay,
                                   mask=decay_mask))


@dataclass
class Steps:
    """The compiled functions of one run (built by `make_steps`)."""

    train: Callable  # (params, opt_state, tokens [accum, micro, t+1]) -> (params, opt_state, metrics)
    eval: Callable  # (params, tokens [b, t+1]) -> (sum nats [t], count [t]) per position
    tx: optax.GradientTransformation
    mesh: Mesh

    @property
    def devices(self) -> list:
        return list(self.mesh.devices.flat)

    def shard_batch(self, tokens: np.ndarray, axis: int) -> jax.Array:
        spec = [None] * tokens.ndim
        spec[axis] = "data"
        return jax.device_put(tokens, NamedSharding(self.mesh, P(*spec)))

    def replicate(self, tree):
        return jax.device_put(tree, NamedSharding(self.mesh, P()))


def make_apply(cfg: ModelConfig, compute_dtype: str) -> Callable[[Params, jax.Array], jax.Array]:
    """(f32 params, tokens [b, t]) -> logits [b, t, v] f32, computed in `compute_dtype`."""
    dt = jnp.dtype(compute_dtype)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(cfg, dtype=dt, rngs=nnx.Rngs(0))))
    dtypes = jax.tree.map(lambda x: x.dtype, nnx.to_pure_dict(abstract))

    def apply(params: Params, tokens: jax.Array) -> jax.Array:
        cast = jax.tree.map(lambda x, d: x.astype(d), params, dtypes)
        return nnx.merge(graphdef, cast)(tokens)

    return apply


def token_nats(apply: Callable, params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """tokens [b, t+1] -> (nats [b, t], mask [b, t]); targets equal to <pad> (0) are masked."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = apply(params, inputs)
    nats = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    mask = (targets != 0).astype(jnp.float32)
    return nats * mask, mask


def make_steps(cfg: ModelConfig, tc: TrainConfig, devices: list | None = None) -> Steps:
    devices = devices or jax.devices()
    tc.check_devices(len(devices))
    mesh = Mesh(np.asarray(devices), ("data",))
    apply = make_apply(cfg, tc.compute_dtype)
    tx = optimizer(tc)

    def loss_fn(params: Params, tokens: jax.Array) -> jax.Array:
        nats, mask = token_nats(apply, params, tokens)
        return nats.sum() / jnp.maximum(mask.sum(), 1.0)

    def train(params: Params, opt_state, tokens: jax.Array):
        def micro(acc, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            return jax.tree.map(jnp.add, acc, grads), loss

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, losses = jax.lax.scan(micro, zeros, tokens)
        grads = jax.tree.map(lambda g: g / tokens.shape[0], grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": losses.mean(), "grad_norm": optax.global_norm(grads)}

    def evaluate(params: Params, tokens: jax.Array):
        nats, mask = token_nats(apply, params, tokens)
        return nats.sum(0), mask.sum(0)

    return Steps(jax.jit(train, donate_argnums=(0, 1)), jax.jit(evaluate), tx, mesh)


def model_flops_per_token(cfg: ModelConfig, params: Params, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul weights (+ the tied head) + attention scores.

    Attention: 12 x heads x head_dim x the mean number of keys a query sees (the window
    caps it). The SSM's scan (elementwise and small chunk products) is left out, so MFU
    is slightly understated.
    """
    n = param_count(params)
    vectors = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params) if x.ndim < 2)
    n_matmul = n - vectors
    if not cfg.tie_embeddings:
        n_matmul -= cfg.vocab_size * cfg.hidden_size  # the input embedding is a gather
    flops = 6.0 * n_matmul
    if cfg.attention is not None:
        hd = cfg.attention.num_heads * cfg.attention.head_dim
        for spec in cfg.layers:
            if spec.kind.has_attention:
                w = spec.window or seq_len
                keys = np.minimum(np.arange(1, seq_len + 1), w).mean()
                flops += 12.0 * hd * keys
    return flops
