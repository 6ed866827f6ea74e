"""Synthetic recall beyond the window: hybrid vs SWA-only vs SSM-only at equal parameters.

The task (multi-query associative recall). A row of T + 1 tokens:

  <bos> filler ... | k1 v1 k2 v2 ... kK vK | G filler tokens | kπ1 vπ1 ... kπK vπK
                     the K pairs               the gap            the K keys again, shuffled

Keys are K distinct ids out of `keys`, values are drawn from `values` ids (chance =
1 / values), filler from its own ids. The model is scored on predicting each value
after its key is asked again (loss and accuracy on those K answers only). The query
block ends the row, so every row has the same shape whatever the gap G; a value lies
between G + 1 and G + 4K - 3 tokens before the position that must produce it.

Attention alone can carry a token at most `layers x (window - 1)` positions (each layer
looks back window - 1 tokens): the stack's reach. Rows whose G + 1 exceeds the reach
are unanswerable for the SWA-only model by construction; the hybrid and SSM-only
models can answer them only through the SSM state.

Training: a curriculum on G. Step s draws each row's G uniformly from
[0, G_max(s)], where G_max grows linearly from `--gap-start` (inside the window: the
easy, attention-solvable case) to the longest gap the row allows over the first
`--ramp` of the steps, then stays there; short gaps stay in the mix. Batches are made
on the device inside the jitted step (`--chunk` steps per call, a lax.scan), so the
host is out of the loop. AdamW with warmup + cosine decay (hybrid_jax.train.step).

Evaluation: accuracy on fresh rows at fixed gaps from 0 to the longest, reported in
three bands: in the window (every answer < window tokens back), between the window
and the reach, and beyond the reach (every answer > layers x (window - 1) back).

The three models share d, layer count, window and the Mamba2/attention shapes; the
MLP width is adjusted so each has the hybrid's parameter count (hybrid_ablation.variants).

  PYTHONPATH=. python benchmarks/recall.py --out /tmp/recall           # one H100, ~3 min
  PYTHONPATH=. python benchmarks/recall.py --smoke --out /tmp/recall   # CPU, toy size
Writes OUT/recall.json and OUT/recall.png and prints a summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.train.config import TrainConfig
from hybrid_jax.train.step import init_params, make_apply, optimizer, param_count

PAD, BOS = 0, 1
FIRST_ID = 3  # ids 0-2 are <pad>, <bos>, <eos>


@dataclass(frozen=True)
class RecallTask:
    length: int  # T: tokens per row fed to the model (the row holds T + 1 with the last target)
    pairs: int  # K
    keys: int  # distinct key ids
    values: int  # distinct value ids (chance = 1 / values)
    filler: int  # distinct filler ids

    def __post_init__(self) -> None:
        if self.keys < self.pairs:
            raise ValueError(f"keys={self.keys} must be >= pairs={self.pairs}")
        if self.max_gap < 0:
            raise ValueError(f"length={self.length} is too short for pairs={self.pairs}")

    @property
    def key0(self) -> int:
        return FIRST_ID

    @property
    def value0(self) -> int:
        return FIRST_ID + self.keys

    @property
    def filler0(self) -> int:
        return self.value0 + self.values

    @property
    def vocab_size(self) -> int:
        return self.filler0 + self.filler

    @property
    def query0(self) -> int:
        """Index of the first query key in the row of T + 1 tokens."""
        return self.length + 1 - 2 * self.pairs

    @property
    def max_gap(self) -> int:
        return self.query0 - 2 * self.pairs - 1  # the pairs start right after <bos>

    def batch(self, key: jax.Array, b: int, gap_lo, gap_hi) -> tuple[jax.Array, jax.Array, jax.Array]:
        """tokens [b, T + 1] int32, the answer mask [b, T] (target t predicts token t + 1) and
        the distances [b, K] from each query's answering position back to its value.

        Each row's gap G is uniform in [gap_lo, gap_hi] (traced scalars are fine).
        """
        k_fill, k_keys, k_vals, k_gap, k_order = jax.random.split(key, 5)
        kk = self.pairs
        toks = jax.random.randint(k_fill, (b, self.length + 1), self.filler0, self.vocab_size)
        toks = toks.at[:, 0].set(BOS)
        keys = self.key0 + jnp.argsort(jax.random.uniform(k_keys, (b, self.keys)), axis=1)[:, :kk]
        vals = self.value0 + jax.random.randint(k_vals, (b, kk), 0, self.values)
        gap = jax.random.randint(k_gap, (b,), gap_lo, gap_hi + 1)
        start = self.query0 - gap - 2 * kk  # [b] index of the first pair's key
        rows = jnp.arange(b)[:, None]
        pos = start[:, None] + 2 * jnp.arange(kk)
        toks = toks.at[rows, pos].set(keys).at[rows, pos + 1].set(vals)
        order = jnp.argsort(jax.random.uniform(k_order, (b, kk)), axis=1)
        qpos = self.query0 + 2 * jnp.arange(kk)
        toks = toks.at[:, qpos].set(jnp.take_along_axis(keys, order, 1))
        toks = toks.at[:, qpos + 1].set(jnp.take_along_axis(vals, order, 1))
        mask = jnp.zeros((b, self.length), bool).at[:, qpos].set(True)
        dist = qpos - jnp.take_along_axis(pos + 1, order, 1)
        return toks.astype(jnp.int32), mask, dist


def recall_model(task: RecallTask, d: int, layers: int, window: int) -> ModelConfig:
    """The hybrid shape of the recall runs (every layer SWA + Mamba2, as native-py-5m)."""
    heads = max(1, d // 32)
    return ModelConfig(
        architecture="native", vocab_size=task.vocab_size, hidden_size=d,
        layers=tuple(LayerSpec("hybrid", window) for _ in range(layers)),
        attention=AttentionConfig(num_heads=heads, num_kv_heads=max(1, heads // 2), head_dim=32),
        mamba2=Mamba2Config(num_heads=heads, head_dim=32, state_size=32, chunk_size=64),
        mlp=MLPConfig(intermediate_size=2 * d), norm_eps=1e-5, tie_embeddings=True,
        bos_token_id=BOS, eos_token_ids=(2,), pad_token_id=PAD)


def variants(base: ModelConfig) -> dict[str, ModelConfig]:
    """hybrid / swa / ssm with the MLP widths chosen to match the hybrid's parameter count."""
    d, n = base.hidden_size, base.num_layers
    w = base.layers[0].window
    count = lambda cfg: param_count(jax.eval_shape(lambda: init_params(cfg, 0)))
    target = count(base)

    def with_kind(kind: str, window: int | None) -> ModelConfig:
        def make(f: int) -> ModelConfig:
            return dataclasses.replace(base, layers=tuple(LayerSpec(kind, window) for _ in range(n)),
                                       mlp=MLPConfig(intermediate_size=f))
        f0 = base.mlp.intermediate_size
        return make(f0 + round((target - count(make(f0))) / (3 * d * n)))

    return {"hybrid": base, "swa": with_kind("attention", w), "ssm": with_kind("mamba2", None)}


def distance_bands(task: RecallTask, window: int, layers: int) -> dict[str, tuple[int, int]]:
    """Answer distances: inside one window / past it, inside the stack's reach / past the reach."""
    reach = layers * (window - 1)
    return {"in_window": (1, window - 1), "past_window": (window, reach),
            "past_reach": (reach + 1, task.max_gap + 4 * task.pairs - 3)}


def train_recall(cfg: ModelConfig, task: RecallTask, a) -> dict:
    """Train on the curriculum; return the loss curve and answers (correct, all) by distance.

    compile_seconds includes the first chunk of steps (the call that compiles).
    """
    tc = TrainConfig(steps=a.steps, batch_size=a.batch, seq_len=task.length, lr=a.lr,
                     warmup_steps=a.warmup, weight_decay=0.0, compute_dtype=a.dtype)
    apply = make_apply(cfg, a.dtype)
    tx = optimizer(tc)
    ramp = max(1, int(a.ramp * a.steps))

    def loss_fn(p, toks, mask):
        nats = optax.softmax_cross_entropy_with_integer_labels(apply(p, toks[:, :-1]), toks[:, 1:])
        return (nats * mask).sum() / mask.sum()

    def one(carry, step):
        p, s, key = carry
        frac = jnp.minimum(step / ramp, 1.0)
        hi = (a.gap_start + frac * (task.max_gap - a.gap_start)).astype(jnp.int32)
        toks, mask, _ = task.batch(jax.random.fold_in(key, step), a.batch, 0, hi)
        loss, g = jax.value_and_grad(loss_fn)(p, toks, mask)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s, key), loss

    @jax.jit
    def chunk(p, s, key, step0):
        (p, s, _), losses = jax.lax.scan(one, (p, s, key), step0 + jnp.arange(a.chunk))
        return p, s, losses

    n_dist = task.length + 1

    @jax.jit
    def hits(p, key):
        """(correct, answers) by distance [T + 1] over one batch of uniformly random gaps."""
        toks, mask, dist = task.batch(key, a.eval_batch, 0, task.max_gap)
        qpos = task.query0 + 2 * jnp.arange(task.pairs)
        hit = (apply(p, toks[:, :-1]).argmax(-1) == toks[:, 1:])[:, qpos]
        return (jnp.bincount(dist.ravel(), hit.ravel().astype(jnp.int32), length=n_dist),
                jnp.bincount(dist.ravel(), length=n_dist))

    params = init_params(cfg, a.seed)
    state = tx.init(params)
    key = jax.random.key(a.seed)
    t0 = time.perf_counter()
    params, state, losses = chunk(params, state, key, 0)  # compiles
    curve = [float(losses.mean())]
    compile_s = time.perf_counter() - t0
    done, t1 = a.chunk, time.perf_counter()
    while done < a.steps and time.perf_counter() - t1 < a.max_seconds:
        params, state, losses = chunk(params, state, key, done)
        done += a.chunk
        curve.append(float(losses.mean()))
    train_s = time.perf_counter() - t1
    test_key = jax.random.key(10_000 + a.seed)  # the same test rows for every model
    correct, count = np.zeros(n_dist), np.zeros(n_dist)
    for r in range(a.eval_batches):
        c, n = jax.device_get(hits(params, jax.random.fold_in(test_key, r)))
        correct, count = correct + c, count + n
    return {"steps": done, "stopped_on_time": done < a.steps, "compile_seconds": compile_s,
            "train_seconds": train_s, "steps_per_s": (done - a.chunk) / max(train_s, 1e-9),
            "loss_curve": curve, "loss_every": a.chunk,
            "correct_by_distance": correct.tolist(), "answers_by_distance": count.tolist()}


def band_accuracy(r: dict, bands: dict) -> dict[str, float | None]:
    correct, count = np.asarray(r["correct_by_distance"]), np.asarray(r["answers_by_distance"])
    out = {}
    for name, (lo, hi) in bands.items():
        n = count[lo:hi + 1].sum()
        out[name] = float(correct[lo:hi + 1].sum() / n) if n else None
    return out


def binned(r: dict, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Accuracy by distance in `bins` equal bins (centres, accuracy)."""
    correct, count = np.asarray(r["correct_by_distance"]), np.asarray(r["answers_by_distance"])
    edges = np.linspace(1, len(count), bins + 1).astype(int)
    c = np.add.reduceat(correct, edges[:-1])
    n = np.add.reduceat(count, edges[:-1])
    keep = n >= 32  # a bin with few answers is noise (the shortest distances need gap 0)
    return ((edges[:-1] + edges[1:]) / 2)[keep], c[keep] / n[keep]


def plot(results: dict, task: RecallTask, window: int, layers: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        x, acc = binned(r, 24)
        ax.plot(x, acc * 100, marker="o", ms=3,
                label=f"{name} ({r['params'] / 1e6:.2f}M)")
        bx.plot(np.arange(len(r["loss_curve"])) * r["loss_every"], r["loss_curve"], label=name)
    ax.axvline(window, color="gray", ls="--", label=f"window {window}")
    ax.axvline(layers * (window - 1), color="black", ls=":", label=f"reach {layers} x {window - 1}")
    ax.axhline(100 / task.values, color="red", lw=0.8, label=f"chance {100 / task.values:.1f}%")
    ax.set_xlabel("distance from the answering position back to the value (tokens)")
    ax.set_ylabel("recall accuracy (%)")
    ax.set_ylim(0, 101)
    ax.legend(fontsize=8)
    bx.set_xlabel("step (curriculum: the longest gap grows to the row's limit)")
    bx.set_ylabel("training loss on the answers (nats)")
    bx.axhline(np.log(task.values), color="red", lw=0.8, label=f"ln {task.values} (chance)")
    bx.legend(fontsize=8)
    fig.suptitle(f"multi-query recall, K={task.pairs} pairs, {task.values} values, rows of {task.length}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SMOKE = dict(d=64, layers=2, window=16, length=96, pairs=4, keys=32, values=8, filler=32, steps=300,
             batch=32, chunk=25, lr=3e-3, warmup=30, gap_start=4, eval_batches=4, eval_batch=64,
             dtype="float32", max_seconds=240.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--smoke", action="store_true", help="CPU toy size (changes the defaults; see SMOKE)")
    p.add_argument("--models", default="hybrid,swa,ssm")
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--length", type=int, default=256, help="row length T")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--keys", type=int, default=64)
    p.add_argument("--values", type=int, default=16)
    p.add_argument("--filler", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--chunk", type=int, default=100, help="steps per jitted call (lax.scan)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--gap-start", type=int, default=8, help="the curriculum's first longest gap")
    p.add_argument("--ramp", type=float, default=0.6, help="fraction of steps over which the gap grows")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--eval-batches", type=int, default=16, help="test batches (random gaps)")
    p.add_argument("--eval-batch", type=int, default=128)
    p.add_argument("--max-seconds", type=float, default=30.0, help="per model, training only (a guard)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.smoke:  # toy defaults; flags given explicitly still win
        p.set_defaults(**SMOKE)
        a = p.parse_args(argv)
    if a.steps % a.chunk:
        raise SystemExit(f"error: steps={a.steps} must be a multiple of chunk={a.chunk}")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    task = RecallTask(a.length, a.pairs, a.keys, a.values, a.filler)
    reach = a.layers * (a.window - 1)
    if task.max_gap <= reach:
        raise SystemExit(f"error: length={a.length} leaves gaps up to {task.max_gap}, not past the "
                         f"reach {a.layers} x ({a.window} - 1) = {reach}")
    bands = distance_bands(task, a.window, a.layers)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    models = variants(recall_model(task, a.d, a.layers, a.window))
    results, t0 = {}, time.perf_counter()
    print(f"devices: {jax.devices()}; task {task}; reach {reach}; bands {bands}", flush=True)
    for name in a.models.split(","):
        cfg = models[name]
        r = train_recall(cfg, task, a)
        r |= {"params": param_count(jax.eval_shape(lambda cfg=cfg: init_params(cfg, 0))),
              "mlp": cfg.mlp.intermediate_size, "bands": band_accuracy(r, bands)}
        results[name] = r
        print(json.dumps({name: {k: r[k] for k in ("params", "steps", "compile_seconds", "train_seconds",
                                                     "bands")}}), flush=True)
        summary = {"task": dataclasses.asdict(task), "window": a.window, "layers": a.layers,
                   "reach": reach, "chance": 1 / task.values, "bands": bands,
                   "settings": vars(a), "device": str(jax.devices()[0].device_kind),
                   "seconds": time.perf_counter() - t0, "results": results}
        (out / "recall.json").write_text(json.dumps(summary, indent=1))
    plot(results, task, a.window, a.layers, out / "recall.png")
    print(table(results, bands, task))
    print(f"total {time.perf_counter() - t0:.0f} s; wrote {out / 'recall.json'} and {out / 'recall.png'}")
    return summary


def table(results: dict, bands: dict, task: RecallTask) -> str:
    names = list(bands)
    head = "| model | params | steps | final loss | " + " | ".join(
        f"{n} ({lo}-{hi} back)" for n, (lo, hi) in bands.items()) + " |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    for name, r in results.items():
        accs = " | ".join("-" if r["bands"][n] is None else f"{100 * r['bands'][n]:.1f}%" for n in names)
        lines.append(f"| {name} | {r['params']:,} | {r['steps']} | {r['loss_curve'][-1]:.3f} | {accs} |")
    lines.append(f"chance {100 / task.values:.1f}%")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
