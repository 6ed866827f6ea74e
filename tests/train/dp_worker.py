"""Data-parallel runs on fake CPU devices, for tests/train/test_data_parallel.py.

Run as `python -m tests.train.dp_worker OUT_DIR` with
XLA_FLAGS=--xla_force_host_platform_device_count=4 set before jax starts (the test
process has usually initialised jax with one device already, hence a subprocess).
Trains the same tiny hybrid on the same global batches on 1, 2 and 4 devices (with
and without gradient accumulation), interrupts and resumes a 4-device run, tries a
micro-batch that does not divide over 4 devices, and writes every result to
OUT_DIR/results.npz + OUT_DIR/results.json; the test compares them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from hybrid_jax.config import ModelConfig
from hybrid_jax.train.dataset import Dataset
from hybrid_jax.train.loop import train
from tests.train.helpers import tiny_model, tiny_train

VOCAB = 64


def model() -> ModelConfig:
    """One parallel-hybrid layer: every code path of the step, the least compile time."""
    cfg = tiny_model(VOCAB)
    return dataclasses.replace(cfg, layers=cfg.layers[:1])


def dataset(held_out: bool = True) -> Dataset:
    """Random rows with some <pad> targets (masked), so micro-batches hold unequal token counts.

    3 held-out rows: the evaluation pads them to a multiple of the devices.
    """
    rng = np.random.default_rng(0)
    rows = rng.integers(3, VOCAB, (32, 17)).astype(np.int32)
    rows[::3, 12:] = 0
    held = rng.integers(3, VOCAB, (3 if held_out else 0, 17)).astype(np.int32)
    return Dataset(tokenizer=None, tokenizer_file=None, train_rows=rows, eval_rows=held,
                   token_bytes=np.ones(VOCAB, np.int64), manifest={})


def settings(**kw):
    return tiny_train(**({"steps": 4, "batch_size": 8, "seq_len": 16, "warmup_steps": 1, "eval_every": 4,
                          "eval_rows": 3} | kw))


def run(root: Path, name: str, n_dev: int, *, stop_at: int | None = None, held_out: bool = False, **kw):
    return train(model(), settings(**kw), dataset(held_out), root / name, quiet=True, export=False,
                 devices=jax.devices()[:n_dev], stop_at=stop_at)


def record(res, run_dir: Path) -> dict:
    log = [json.loads(x) for x in (run_dir / "train_log.jsonl").read_text().splitlines()]
    leaves = jax.tree.leaves(res.params)
    return {"eval_loss": res.eval and res.eval["loss"],
            "train_loss": [r["loss"] for r in log if r["kind"] == "train"],
            "num_devices": log[0]["num_devices"],
            "param_devices": sorted({len(x.sharding.device_set) for x in leaves})}


def main(out: Path) -> None:
    assert jax.device_count() == 4, jax.devices()
    # the resumed run compiles what its uninterrupted twin compiled: a persistent cache hit
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="dp-xla-"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    root = Path(tempfile.mkdtemp(prefix="dp-"))
    arrays, info = {}, {"devices": jax.device_count()}
    runs = {"d1_a1": (1, 1), "d2_a1": (2, 1), "d4_a1": (4, 1), "d1_a2": (1, 2), "d4_a2": (4, 2)}
    for name, (n_dev, accum) in runs.items():
        res = run(root, name, n_dev, grad_accum=accum, log_every=1, held_out=accum == 1)
        arrays |= {f"{name}/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(res.params))}
        info[name] = record(res, root / name)
    # 4 devices, accumulation: stopped after step 2 (a checkpoint is written there), then a
    # fresh train() on the same directory resumes; compared with d4_a2 (uninterrupted)
    first = run(root, "resumed", 4, grad_accum=2, log_every=1, stop_at=2)
    resumed = run(root, "resumed", 4, grad_accum=2, log_every=1)
    info["resume"] = {"first_step": first.step, "resumed_step": resumed.step}
    arrays |= {f"resumed/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(resumed.params))}
    arrays |= {f"first/{i}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(first.params))}
    try:  # 6 sequences per micro-step over 4 devices
        run(root, "refused", 4, batch_size=6)
        info["refused"] = None
    except ValueError as err:
        info["refused"] = str(err)
    np.savez(out / "results.npz", **arrays)
    (out / "results.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
