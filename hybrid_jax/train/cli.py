"""`hybrid-jax train`: arguments, checks that fail at once, then data, loop and export.

Settings are checked before any data is read (unknown preset, missing data path,
bad optimiser settings, a batch that does not divide over the devices); the batch
is checked against the packed corpus and the device memory before the first step.
Each failure is one line naming the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from hybrid_jax.train.config import COMPUTE_DTYPES, TrainConfig

EPILOG = """examples:
  # the shipped default model (docs/training.md has the exact recipe)
  hybrid-jax train --data stdlib --preset native-py-5m --out runs/py5m --steps 3000
  # a small CPU run on your own files, with a byte-level tokenizer
  hybrid-jax train --data ./src --preset native-tiny --tokenizer configs/tokenizers/byte-level.json \\
      --out runs/tiny --steps 50 --batch-size 4 --seq-len 128 --dtype float32
Re-running the same command resumes from the run's last checkpoint.
"""

_D = TrainConfig()
HELP = {
    "steps": "optimizer steps", "batch_size": "sequences per optimizer step (all devices, micro-steps)",
    "grad_accum": "micro-steps per optimizer step (gradient accumulation)",
    "seq_len": "tokens per training row", "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "cosine decay ends at lr x this", "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW decay (matrices only)", "clip_norm": "global gradient-norm clip",
    "b1": "Adam beta1", "b2": "Adam beta2", "compute_dtype": "forward/backward dtype (weights stay f32)",
    "seed": "initialisation and data order", "vocab_size": "of the BPE tokenizer trained without --tokenizer",
    "eval_fraction": "of the files held out", "eval_every": "steps between held-out evaluations",
    "eval_rows": "held-out rows per evaluation (at most)", "ckpt_every": "steps between checkpoints",
    "log_every": "steps between log lines",
}


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.epilog = EPILOG
    p.add_argument("--data", action="append", required=True,
                   help="a .py file, a directory (searched recursively) or 'stdlib'; repeatable")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--preset", help="model preset (default native-py-5m, or --init-from's config)")
    m.add_argument("--model-config", help="a ModelConfig JSON file instead of a preset")
    p.add_argument("--init-from", metavar="MODEL_DIR",
                   help="start a new run from the parameters of this exported native model "
                        "(its config and tokenizer.json unless given; fresh optimizer state, the "
                        "schedule from step 0); ignored when --out holds checkpoints to resume")
    p.add_argument("--tokenizer", help="an existing tokenizer.json (default: train a BPE tokenizer, "
                   "or --init-from's)")
    p.add_argument("--held-out", help="hold out exactly these files: a run's corpus.json (its "
                   "held_out_files) or a list of names, one a line (default: --eval-fraction by hash)")
    p.add_argument("--max-file-bytes", type=int,
                   help="skip files larger than this (generated tables; default: no limit)")
    p.add_argument("--out", required=True, help="run directory (checkpoints, logs, model/)")
    p.add_argument("--export-dtype", default="float32", choices=COMPUTE_DTYPES,
                   help="dtype of the exported model's parameters (default float32)")
    p.add_argument("--max-seconds", type=float,
                   help="stop (checkpoint and export) after this much training time")
    p.add_argument("--num-devices", type=int,
                   help="data-parallel over the first N devices (default: all of them)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    g = p.add_argument_group("optimisation")
    for f in dataclasses.fields(TrainConfig):
        flag = "--dtype" if f.name == "compute_dtype" else "--" + f.name.replace("_", "-")
        kw = {"choices": COMPUTE_DTYPES} if f.name == "compute_dtype" else {}
        g.add_argument(flag, dest=f.name, type=type(getattr(_D, f.name)), default=getattr(_D, f.name),
                       help=f"{HELP[f.name]} (default {getattr(_D, f.name)})", **kw)


def _model_config(args: argparse.Namespace):
    from hybrid_jax.config import ModelConfig
    from hybrid_jax.presets import preset_names

    if args.model_config is not None:
        path = Path(args.model_config)
        if not path.is_file():
            raise ValueError(f"model_config={args.model_config!r} is not a file")
        return ModelConfig.from_dict(json.loads(path.read_text()))
    if args.preset is None and args.init_from is not None:
        from hybrid_jax.checkpoints.native import CONFIG_FILE, is_native_dir

        if not is_native_dir(args.init_from):
            raise ValueError(f"init_from={args.init_from!r} is not a native model directory "
                             f"(no {CONFIG_FILE})")
        return ModelConfig.from_dict(json.loads((Path(args.init_from) / CONFIG_FILE).read_text()))
    args.preset = args.preset or "native-py-5m"
    if args.preset not in preset_names():
        raise ValueError(f"preset={args.preset!r} is not a preset ({', '.join(preset_names())})")
    from hybrid_jax.presets import load_preset

    return load_preset(args.preset)


def _with_tokenizer(cfg, vocab_size: int):
    from hybrid_jax.train.data import BOS, EOS, PAD

    return dataclasses.replace(cfg, vocab_size=vocab_size, bos_token_id=BOS, eos_token_ids=(EOS,),
                               pad_token_id=PAD)


def _devices(num_devices: int | None, available: list) -> list:
    if num_devices is None:
        return available
    if not 1 <= num_devices <= len(available):
        raise ValueError(f"num_devices={num_devices} must be in [1, {len(available)}] "
                         f"(the {available[0].platform} devices here)")
    return available[:num_devices]


def run_train(args: argparse.Namespace) -> int:
    """Check everything cheap first, then prepare data, train, export. Raises ValueError."""
    import jax

    from hybrid_jax.train.corpus import resolve_data

    tc = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    cfg = _model_config(args)
    data = resolve_data(args.data)
    for d in data:
        if not Path(d).exists():
            raise ValueError(f"data={d!r} does not exist")
    devices = _devices(args.num_devices, jax.devices())
    tc.check_devices(len(devices))
    from hybrid_jax.train.dataset import prepare
    from hybrid_jax.train.loop import train

    tokenizer = args.tokenizer
    if tokenizer is None and args.init_from is not None:
        tokenizer = str(Path(args.init_from) / "tokenizer.json")
        if not Path(tokenizer).is_file():
            raise ValueError(f"init_from={args.init_from!r} has no tokenizer.json: give --tokenizer")
    ds = prepare(data, tc, args.out, tokenizer=tokenizer, held_out=args.held_out,
                 max_file_bytes=args.max_file_bytes)
    cfg = _with_tokenizer(cfg, ds.tokenizer.vocab_size)
    init = None
    if args.init_from is not None:
        from hybrid_jax.train.checkpoint import load_init_params

        init = load_init_params(args.init_from, cfg)
    res = train(cfg, tc, ds, args.out, quiet=args.quiet, export_dtype=args.export_dtype,
                max_seconds=args.max_seconds, devices=devices, init=init,
                init_from=None if args.init_from is None else str(Path(args.init_from).absolute()))
    ev = res.eval or {}
    print(json.dumps({"step": res.step, "num_devices": len(devices), "stopped_early": res.stopped_early,
                      "held_out_loss": ev.get("loss"),
                      "bits_per_byte": ev.get("bits_per_byte"),
                      "tokens_per_s": res.tokens_per_s, "mfu": res.mfu,
                      "model": str(Path(args.out) / "model")}))
    return 0
