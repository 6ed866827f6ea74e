"""What the hybrid buys: hybrid vs sliding-window-only vs SSM-only at equal parameters.

Three models of one shape (default: native-py-5m, d=256, 5 layers, window 128; or
`--model-config`, e.g. benchmarks/default_model_config.json, the default model's shape):
  hybrid  SWA + Mamba2 in every layer (the preset)
  swa     attention only; the MLP widened to make up Mamba2's parameters
  ssm     Mamba2 only; the MLP widened to make up attention's parameters
1. Language modelling: the same data (the stdlib corpus, the shipped tokenizer), the
   same steps, batch and schedule; held-out loss by token position (seq_len 512).
2. Synthetic recall beyond the window: benchmarks/recall.py (its own smaller shape and
   vocabulary, a curriculum on the distance; its docstring has the details), run after
   the language-modelling part, or alone with --recall-only.
Writes OUT/ablation.json and OUT/ablation_loss_by_position.png (+ OUT/recall.json and
OUT/recall.png from the recall part).

  PYTHONPATH=. python benchmarks/hybrid_ablation.py --tokenizer configs/default_model/tokenizer.json \
      --out /tmp/abl
  PYTHONPATH=. python benchmarks/hybrid_ablation.py --recall-only --out /tmp/recall     # ~3 min, one H100
  PYTHONPATH=. python benchmarks/hybrid_ablation.py --recall-only --smoke --out /tmp/r  # CPU, toy size
Arguments this script does not know are passed to benchmarks/recall.py (see its --help).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import numpy as np

from hybrid_jax.config import ModelConfig
from hybrid_jax.presets import load_preset
from hybrid_jax.train.cli import _with_tokenizer
from hybrid_jax.train.config import TrainConfig
from hybrid_jax.train.corpus import resolve_data
from hybrid_jax.train.dataset import prepare
from hybrid_jax.train.loop import train
from hybrid_jax.train.step import init_params, param_count

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recall  # noqa: E402  (benchmarks/recall.py, beside this file)


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
    p.add_argument("--tokenizer", help="the LM part's tokenizer (the shipped model's); not for --recall-only")
    p.add_argument("--data", action="append", default=None)
    p.add_argument("--out", required=True)
    p.add_argument("--model-config", help="the hybrid's ModelConfig JSON (default: the native-py-5m preset)")
    p.add_argument("--work", default="/tmp/hybrid-ablation")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lm-seconds", type=float, default=90.0)
    p.add_argument("--recall-only", action="store_true", help="only the synthetic recall comparison")
    p.add_argument("--no-recall", action="store_true", help="only the language-modelling comparison")
    p.add_argument("--smoke", action="store_true", help="recall at CPU toy size (with --recall-only)")
    a, recall_args = p.parse_known_args()
    recall_args = ["--out", a.out, *(["--smoke"] if a.smoke else []), *recall_args]
    if a.recall_only:
        recall.main(recall_args)
        return
    if a.tokenizer is None:
        p.error("--tokenizer is required for the language-modelling part (or give --recall-only)")
    if a.smoke:
        p.error("--smoke applies to the recall part: give --recall-only")
    language_modelling(a)
    if not a.no_recall:
        recall.main(recall_args)


def language_modelling(a: argparse.Namespace) -> None:
    tc = TrainConfig(steps=a.steps, batch_size=a.batch_size, seq_len=512, lr=2e-3,
                     warmup_steps=min(50, a.steps // 4), eval_every=a.steps, eval_rows=256,
                     ckpt_every=a.steps, log_every=max(1, a.steps // 10))
    data = prepare(resolve_data(a.data or ["stdlib"]), tc, Path(a.work) / "data", tokenizer=a.tokenizer)
    shape = (ModelConfig.from_dict(json.loads(Path(a.model_config).read_text())) if a.model_config
             else load_preset("native-py-5m"))
    base = _with_tokenizer(shape, data.tokenizer.vocab_size)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    window = base.layers[0].window
    results = {}
    for name, cfg in recall.variants(base).items():  # results written after each model
        n = param_count(jax.eval_shape(lambda cfg=cfg: init_params(cfg, 0)))
        results[name] = {"params": n, "mlp": cfg.mlp.intermediate_size,
                         "lm": lm(cfg, name, data, tc, a, window)}
        r = results[name]
        print(json.dumps({name: {"params": n, "held_out_loss": r["lm"]["held_out_loss"],
                                 "bands": r["lm"]["loss_by_band"]}}), flush=True)
        (out / "ablation.json").write_text(json.dumps({
            "train": tc.to_dict(), "window": window, "model_config": a.model_config or "native-py-5m",
            "stack_receptive_field": base.num_layers * (window - 1), "results": results}, indent=1))
    plot(results, window, out / "ablation_loss_by_position.png")


if __name__ == "__main__":
    main()
