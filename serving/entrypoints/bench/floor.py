"""The byte floor of a decode step and the copy bandwidth it is measured against.

A decode step must at least read every weight once (the input embedding only for the
rows it gathers, unless it is tied to the LM head), read the in-window K/V of every
attention layer and write the new token's K/V, and read and write every recurrent
state once. Those bytes over the device's copy bandwidth (a large device-to-device
copy timed in the same run, counting bytes read plus bytes written) are the floor;
a measured step over it is the gap. Activations and logits are not counted (they are
small next to the rest at these shapes). `decode_floor_bytes` computes it from the model
config alone, independently of the engine's own allocation arithmetic;
`engine_floor_bytes` from an engine's caches at each sequence's real context (the step
anatomy's floor). A prefill step is judged by its model FLOPs (`model_flops`) against
the rate of a large bf16 matmul measured in the same process (`matmul_rate`).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.cache import states_of
from hybrid_jax.config import LayerKind, ModelConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def expert_params(cfg: ModelConfig) -> int:
    """Parameters of one routed expert (gate and up, or up alone, and down)."""
    m = cfg.moe
    return (3 if m.gated else 2) * cfg.hidden_size * m.intermediate_size


def touched_experts(cfg: ModelConfig, batch: int) -> float:
    """Experts a decode step of `batch` tokens touches per MoE layer, expected under uniform
    routing: E (1 - (1 - k/E)^batch). A skewed router touches fewer, and the floor is then
    lower than this one, so a step's ratio to this floor flatters it. Random-weight presets
    can be far from uniform: granite-4.0-h-tiny's batch-64 step on an H100 streamed at most
    ~26% of its experts (its grouped GEMMs took 1.08 ms, reading all 64 of 40 layers takes
    4.2 ms; docs/benchmarks.md), where uniform routing touches all. The MoE kernel
    benchmark (benchmarks/moe.py) routes uniformly by construction and counts exactly."""
    e, k = cfg.moe.num_experts, cfg.moe.top_k
    return e * (1.0 - (1.0 - k / e) ** batch)


def decode_floor_bytes(cfg: ModelConfig, *, batch: int, context: int, weight_bytes: int,
                       dtype: str, state_dtype: str = "float32",
                       expert_itemsize: float | None = None, touched: float | None = None) -> dict[str, int]:
    """Bytes one decode step of `batch` sequences at `context` cached tokens must move.

    A mixture-of-experts layer reads only the experts its tokens touch (`touched`, measured
    by `measured_touched_experts`; default: uniform routing's `touched_experts`);
    `expert_itemsize` is the bytes per expert weight as held (default: `dtype`'s; 1 + the
    scales' share for FP8 experts)."""
    kv_b, st_b = DTYPE_BYTES[dtype], DTYPE_BYTES[state_dtype]
    weights = weight_bytes
    moe_layers = sum(1 for s in cfg.layers if s.moe) if cfg.moe is not None else 0
    if moe_layers:  # weight_bytes holds every expert: drop the untouched ones' share
        untouched = cfg.moe.num_experts - (touched_experts(cfg, batch) if touched is None else touched)
        item = expert_itemsize if expert_itemsize is not None else kv_b
        weights -= int(moe_layers * untouched * expert_params(cfg) * item)
    if not cfg.tie_embeddings:  # the input table is gathered, not read whole
        weights -= cfg.vocab_size * cfg.hidden_size * kv_b
        weights += batch * cfg.hidden_size * kv_b
    kv = state = 0
    for spec in cfg.layers:
        if spec.kind.has_attention:
            a = cfg.attention
            seen = context + 1 if spec.window is None else min(context + 1, spec.window)
            # read (the new one written); MLA reads its latent rows (r + dr values), no V
            width = cfg.mla.latent_width if cfg.mla is not None else 2 * a.num_kv_heads * a.head_dim
            kv += batch * seen * width * kv_b
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            state += 2 * batch * m.num_heads * m.head_dim * m.state_size * st_b
            state += 2 * batch * (m.conv_kernel - 1) * m.conv_dim * kv_b
        if spec.kind == LayerKind.MAMBA1:
            m1 = cfg.mamba1
            state += 2 * batch * m1.d_inner * (m1.state_size * st_b + (m1.conv_kernel - 1) * kv_b)
        if spec.kind == LayerKind.RGLRU:
            r = cfg.rglru
            state += 2 * batch * (r.width * 4 + (r.conv_kernel - 1) * r.width * kv_b)
        if spec.kind == LayerKind.GATED_DELTANET:
            g = cfg.gated_deltanet
            state += 2 * batch * g.num_v_heads * g.head_k_dim * g.head_v_dim * st_b
            state += 2 * batch * (g.conv_kernel - 1) * g.conv_dim * kv_b
    return {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s (read + write) of an elementwise pass over an `nbytes` f32 buffer.

    Each sample times 10 passes back to back (one sync: a per-call sync costs the small
    buffers of CPU smoke runs most of their time); the median of `reps` samples.
    """
    n = max(1, nbytes // 4)
    x = jnp.arange(n, dtype=jnp.float32)
    step = jax.jit(lambda a: a + 1.0)
    step(x).block_until_ready()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(10):
            y = step(x)
        y.block_until_ready()
        times.append((time.perf_counter() - t) / 10)
    del x
    return 2 * n * 4 / statistics.median(times)


def floor_report(cfg: ModelConfig, *, batch: int, context: int, weight_bytes: int, dtype: str,
                 step_s: float, bandwidth: float, state_dtype: str = "float32",
                 expert_itemsize: float | None = None) -> dict[str, float]:
    """The floor (bytes, ms) of one decode step and the measured step's ratio to it."""
    b = decode_floor_bytes(cfg, batch=batch, context=context, weight_bytes=weight_bytes, dtype=dtype,
                           state_dtype=state_dtype, expert_itemsize=expert_itemsize)
    floor_s = b["total"] / bandwidth
    return {"floor_bytes": b["total"], "floor_weights_bytes": b["weights"], "floor_kv_bytes": b["kv"],
            "floor_state_bytes": b["state"], "floor_ms": 1e3 * floor_s, "gap_x": step_s / floor_s}


def measured_touched_experts(model, token_ids: list[list[int]], steps: int, group: int = 16,
                             check: dict | None = None) -> float:
    """Experts per MoE layer that a decode step of these sequences touches, counted from
    the model's own routing (`moe.record_routing` over full-sequence forwards of `group`
    sequences at a time, right-padded): for each of the last `steps` positions of every
    sequence (a decode step reads one position of each), the distinct experts the batch's
    tokens at that step chose, per layer; the mean over steps and layers. The floor of a
    random-weight MoE preset needs it: its router can be far from uniform (`touched_experts`).

    `check` (a dict, filled in): whether that forward agrees with the engine that produced
    the sequences greedily: `greedy_agree`, the share of the last `steps` tokens of each
    sequence that the forward's argmax at the position before predicts, and
    `distinct_last_tokens` across the sequences (the routing counted here is only the
    engine's if the two agree)."""
    from flax import nnx

    from hybrid_jax.layers.moe import record_routing

    graphdef, state = nnx.split(model)
    hidden = jax.jit(lambda st, x: nnx.merge(graphdef, st).hidden(x))
    logits = jax.jit(lambda st, h: jnp.argmax(nnx.merge(graphdef, st).logits(h), axis=-1))
    agree = total = 0
    chosen: dict[tuple[int, int], set[int]] = {}  # (layer, step) -> experts
    width = max(len(t) for t in token_ids)  # one shape for every group: one compilation
    for g in range(0, len(token_ids), group):
        part = token_ids[g:g + group]
        lens = np.array([len(t) for t in part])
        tokens = np.zeros((group, width), np.int32)
        for i, t in enumerate(part):
            tokens[i, :len(t)] = t
        with record_routing() as rec:
            h = jax.block_until_ready(hidden(state, jnp.asarray(tokens)))
            jax.effects_barrier()
        if check is not None:  # the argmax at len - j - 1 against the token at len - j
            rows = np.arange(len(part))
            for j in range(1, min(steps, int(lens.min()) - 1) + 1):
                pred = np.asarray(logits(state, h[rows, lens - j - 1]))
                agree += int((pred == tokens[rows, lens - j]).sum())
                total += len(part)
        if not rec:
            raise ValueError("measured_touched_experts: the model has no MoE layer")
        for layer, experts in enumerate(rec):  # one MoE layer: [group * t, k]
            experts = experts.reshape(group, tokens.shape[1], -1)[:len(part)]
            for j in range(1, steps + 1):  # the step that read position len - j of each
                at = experts[np.arange(len(part)), np.maximum(lens - j, 0)]
                chosen.setdefault((layer, j), set()).update(at.ravel().tolist())
    if check is not None:
        check["greedy_agree"] = agree / max(total, 1)
        check["distinct_last_tokens"] = len({t[-1] for t in token_ids})
    return float(np.mean([len(v) for v in chosen.values()]))


def engine_floor_bytes(engine, lengths: np.ndarray, touched: float | None = None) -> dict[str, int]:
    """Weights once (of a mixture of experts, the share its touched experts hold), each
    sequence's in-window K/V once, recurrent state read + written, from the engine's own
    parameters and caches.

    lengths [b]: each sequence's keys in cache in the step (its context). They differ:
    sequences admitted early have decoded while later ones still prefilled. `touched`:
    experts touched per MoE layer (`measured_touched_experts`); default: uniform routing's.
    """
    cfg, runner = engine.model_config, engine.runner
    weights = sum(x.nbytes for x in jax.tree.leaves(runner.params))
    batch = len(lengths)
    if cfg.moe is not None and any(s.moe for s in cfg.layers):
        # the experts' bytes as held (FP8 or not): every routed-expert tensor is stacked [E, ...]
        e, lay = cfg.moe.num_experts, runner.layout  # params are packed: the layout's leaves
        expert = sum(int(np.prod(shape)) * jnp.dtype(lay.dtypes[buf]).itemsize
                     for buf, _, shape in lay.leaves if len(shape) >= 3 and shape[0] == e)
        touched = touched_experts(cfg, batch) if touched is None else touched
        weights -= int(expert * (1.0 - touched / e))
    kv = state = 0
    for window, cache in zip(cfg.windows, runner.caches.kv, strict=True):
        # K and V [k, layers, pages, s, e]; an MLA model's V is empty (its latent cache)
        per_token = sum(x.shape[0] * x.shape[1] * x.shape[4] * x.dtype.itemsize for x in (cache.k, cache.v))
        seen = lengths if window is None else np.minimum(lengths, window)
        kv += int(seen.sum()) * per_token
    for x in jax.tree.leaves(states_of(runner.caches)):  # [layers, slots, ...]
        state += 2 * batch * (x.nbytes // x.shape[1])
    return {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an [n, n] x [n, n] bf16 matmul (the best of 5 samples of 10 calls)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            c = f(a, b)
        c.block_until_ready()
        ts.append((time.perf_counter() - t) / 10)
    return 2 * n**3 / min(ts)


def model_flops(engine, context: int) -> float:
    """FLOPs per prompt token at mean attention span `context`: 2 x the parameters touched
    per token (every weight but the embedding table; a tied head counts once) + attention
    4 x heads x head_dim x keys in the window + SSD 2 x heads x head_dim x (3 x state +
    chunk) (the chunked form counted at its matmul size) + the gated delta rule 6 x value
    heads x d_k x d_v (its recurrent form: three state-sized products per token). A token
    passes through top_k of a mixture's experts: the others' parameters are not counted."""
    cfg = engine.model_config
    params = sum(x.size for x in jax.tree.leaves(engine.runner.params))
    if cfg.moe is not None:
        idle = cfg.moe.num_experts - cfg.moe.top_k
        params -= sum(1 for s in cfg.layers if s.moe) * idle * expert_params(cfg)
    dense = 2 * (params - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1))
    att = ssm = 0
    for spec in cfg.layers:
        if spec.kind.has_attention:
            a = cfg.attention
            keys = context if spec.window is None else min(context, spec.window)
            att += 4 * a.num_heads * a.head_dim * keys
        if spec.kind.has_mamba2:
            m = cfg.mamba2
            ssm += 2 * m.num_heads * m.head_dim * (3 * m.state_size + m.chunk_size)
        if spec.kind == LayerKind.MAMBA1:  # the scan's elementwise work: ~6 flops per state entry
            ssm += 6 * cfg.mamba1.d_inner * cfg.mamba1.state_size
        if spec.kind == LayerKind.GATED_DELTANET:  # read S^T k, write k delta^T, read S^T q
            g = cfg.gated_deltanet
            ssm += 6 * g.num_v_heads * g.head_k_dim * g.head_v_dim
    return dense + att + ssm
