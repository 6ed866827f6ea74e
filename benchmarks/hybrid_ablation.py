"""What the hybrid buys: hybrid vs sliding-window-only vs SSM-only at equal parameters.

Three models of the native-py-5m shape (d=256, 5 layers, window 128):
  hybrid  SWA + Mamba2 in every layer (the preset)
  swa     attention only; the MLP widened to make up Mamba2's parameters
  ssm     Mamba2 only; the MLP widened to make up attention's parameters
1. Language modelling: the same data (the stdlib corpus, the shipped tokenizer), the
   same steps, batch and schedule; held-out loss by token position (seq_len 512).
2. Synthetic recall: K key-value pairs right after <bos>, filler, then the K keys again
   (shuffled), each to be answered with its value. The answers lie further back than
   the window AND than the stack's receptive field (layers x (window - 1)), so
   attention alone cannot reach them. Loss on the answers only; accuracy on fresh
   sequences (chance = 1 / values).
Writes OUT/ablation.json and OUT/ablation_loss_by_position.png.

  python benchmarks/hybrid_ablation.py --tokenizer hybrid_jax/.../tokenizer.json --out /tmp/abl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import numpy as np
import optax

from hybrid_jax.config import LayerSpec, MLPConfig, ModelConfig
from hybrid_jax.presets import load_preset
from hybrid_jax.train.cli import _with_tokenizer
from hybrid_jax.train.config import TrainConfig
from hybrid_jax.train.corpus import resolve_data
from hybrid_jax.train.dataset import prepare
from hybrid_jax.train.loop import train
from hybrid_jax.train.step import init_params, make_apply, param_count


def variants(base: ModelConfig) -> dict[str, ModelConfig]:
    """hybrid / swa / ssm with the MLP widths chosen to match the hybrid's parameter count."""
    d, n = base.hidden_size, base.num_layers
    w = base.layers[0].window
    target = param_count(jax.eval_shape(lambda: init_params(base, 0)))

    def with_kind(kind: str, window: int | None) -> ModelConfig:
        def make(f: int) -> ModelConfig:
            return dataclasses.replace(base, layers=tuple(LayerSpec(kind, window) for _ in range(n)),
                                       mlp=MLPConfig(intermediate_size=f))
        f0 = base.mlp.intermediate_size
        short = target - param_count(jax.eval_shape(lambda: init_params(make(f0), 0)))
        return make(f0 + round(short / (3 * d * n)))

    return {"hybrid": base, "swa": with_kind("attention", w), "ssm": with_kind("mamba2", None)}


def recall_batch(rng: np.random.Generator, b: int, length: int, k: int, n_values: int) -> tuple:
    """tokens [b, length + 1] and the target mask [b, length] (True at the K answers)."""
    toks = rng.integers(3000, 4000, (b, length + 1))
    keys = 1000 + np.argsort(rng.random((b, 500)), axis=1)[:, :k]
    vals = 2000 + rng.integers(0, n_values, (b, k))
    toks[:, 0] = 1
    toks[:, 1:2 * k + 1:2], toks[:, 2:2 * k + 2:2] = keys, vals
    order = np.argsort(rng.random((b, k)), axis=1)
    q0 = length + 1 - 2 * k
    toks[:, q0::2] = np.take_along_axis(keys, order, 1)
    toks[:, q0 + 1::2] = np.take_along_axis(vals, order, 1)
    mask = np.zeros((b, length), bool)
    mask[:, q0::2] = True  # target index i predicts token i + 1: the values
    return toks.astype(np.int32), mask


def recall(cfg: ModelConfig, a) -> dict:
    apply = make_apply(cfg, "bfloat16")
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, a.recall_lr, min(50, a.recall_steps // 4), a.recall_steps,
                                          a.recall_lr * 0.1),
        weight_decay=0.0))

    def loss_fn(p, toks, mask):
        logits = apply(p, toks[:, :-1])
        nats = optax.softmax_cross_entropy_with_integer_labels(logits, toks[:, 1:])
        return (nats * mask).sum() / mask.sum()

    @jax.jit
    def step(p, s, toks, mask):
        loss, g = jax.value_and_grad(loss_fn)(p, toks, mask)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    @jax.jit
    def correct(p, toks, mask):
        hit = apply(p, toks[:, :-1]).argmax(-1) == toks[:, 1:]
        return (hit & mask).sum()

    rng = np.random.default_rng(0)
    params = init_params(cfg, 1)
    state = tx.init(params)
    t0, done = time.perf_counter(), 0
    while done < a.recall_steps and time.perf_counter() - t0 < a.recall_seconds:
        toks, mask = recall_batch(rng, a.recall_batch, a.recall_len, a.recall_pairs, a.recall_values)
        params, state, loss = step(params, state, toks, mask)
        done += 1
    test = np.random.default_rng(12345)
    hits = total = 0
    for _ in range(8):
        toks, mask = recall_batch(test, 64, a.recall_len, a.recall_pairs, a.recall_values)
        hits += int(correct(params, toks, mask))
        total += int(mask.sum())
    return {"steps": done, "final_train_loss": float(loss), "accuracy": hits / total,
            "chance": 1 / a.recall_values, "seconds": time.perf_counter() - t0}


def lm(cfg: ModelConfig, name: str, data, tc: TrainConfig, a, w: int) -> dict:
    res = train(cfg, tc, data, Path(a.work) / name, quiet=True, export=False, max_seconds=a.lm_seconds)
    by_pos = np.asarray(res.eval["loss_by_position"])
    bands = {f"{lo}-{hi - 1}": float(by_pos[lo:hi].mean())
             for lo, hi in ((0, 32), (32, w), (w, 2 * w), (2 * w, tc.seq_len))}
    return {"steps": res.step, "held_out_loss": res.eval["loss"], "bits_per_byte": res.eval["bits_per_byte"],
            "loss_by_band": bands, "loss_by_position": by_pos.tolist(), "tokens_per_s": res.tokens_per_s}


def plot(results: dict, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        y = np.convolve(r["lm"]["loss_by_position"], np.ones(16) / 16, mode="valid")
        ax.plot(np.arange(len(y)) + 8, y, label=f"{name} ({r['params'] / 1e6:.2f}M)")
    ax.axvline(window, color="gray", ls="--", label=f"window {window}")
    ax.set_xlabel("token position in the 512-token row")
    ax.set_ylabel("held-out loss (nats/token, 16-token mean)")
    ax.set_title("held-out Python (stdlib + packages): equal parameters, data and steps")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--data", action="append", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--work", default="/tmp/hybrid-ablation")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lm-seconds", type=float, default=90.0)
    p.add_argument("--recall-steps", type=int, default=400)
    p.add_argument("--recall-batch", type=int, default=32)
    p.add_argument("--recall-len", type=int, default=768)
    p.add_argument("--recall-pairs", type=int, default=8)
    p.add_argument("--recall-values", type=int, default=64)
    p.add_argument("--recall-lr", type=float, default=1e-3)
    p.add_argument("--recall-seconds", type=float, default=60.0)
    a = p.parse_args()
    tc = TrainConfig(steps=a.steps, batch_size=a.batch_size, seq_len=512, lr=2e-3,
                     warmup_steps=min(50, a.steps // 4), eval_every=a.steps, eval_rows=256,
                     ckpt_every=a.steps, log_every=max(1, a.steps // 10))
    data = prepare(resolve_data(a.data or ["stdlib"]), tc, Path(a.work) / "data", tokenizer=a.tokenizer)
    base = _with_tokenizer(load_preset("native-py-5m"), data.tokenizer.vocab_size)
    if base.vocab_size < 4000:
        raise ValueError(f"the recall task uses ids up to 4000; the tokenizer has {base.vocab_size}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    window = base.layers[0].window
    results = {}
    for name, cfg in variants(base).items():  # results written after each model
        n = param_count(jax.eval_shape(lambda cfg=cfg: init_params(cfg, 0)))
        results[name] = {"params": n, "mlp": cfg.mlp.intermediate_size,
                         "lm": lm(cfg, name, data, tc, a, window), "recall": recall(cfg, a)}
        r = results[name]
        print(json.dumps({name: {"params": n, "held_out_loss": r["lm"]["held_out_loss"],
                                 "bands": r["lm"]["loss_by_band"], "recall": r["recall"]}}), flush=True)
        (out / "ablation.json").write_text(json.dumps({
            "train": tc.to_dict(),
            "recall_settings": {k: getattr(a, k) for k in vars(a) if k.startswith("recall")},
            "window": window, "stack_receptive_field": base.num_layers * (window - 1),
            "results": results}, indent=1))
    plot(results, window, out / "ablation_loss_by_position.png")


if __name__ == "__main__":
    main()
