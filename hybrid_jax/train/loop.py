"""The training loop: resume, step, log, evaluate, checkpoint, export.

`train` is what `hybrid-jax train` runs once the settings are checked and the data
is prepared. A run directory holds tokenizer.json, corpus.json, train_log.jsonl,
checkpoints/ (orbax, for resuming) and model/ (the exported native model).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hybrid_jax.config import ModelConfig
from hybrid_jax.train.checkpoint import TrainCheckpoints, export_model
from hybrid_jax.train.config import TrainConfig
from hybrid_jax.train.data import batch_indices
from hybrid_jax.train.dataset import Dataset
from hybrid_jax.train.progress import RunLog
from hybrid_jax.train.step import (
    Params,
    Steps,
    init_params,
    make_steps,
    model_flops_per_token,
    param_count,
    schedule,
)

# Dense bf16 peak (datasheet, TFLOP/s) by device kind, for model-FLOPs utilisation.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}


@dataclass
class TrainResult:
    params: Params
    step: int
    eval: dict | None
    tokens_per_s: float | None
    mfu: float | None
    stopped_early: bool = False


def evaluate(steps: Steps, params: Params, data: Dataset, tc: TrainConfig) -> dict | None:
    """Held-out loss (nats/token), bits per byte and loss by position over <= eval_rows rows."""
    rows = data.eval_rows[:tc.eval_rows]
    if not len(rows):
        return None
    n_dev = steps.mesh.devices.size
    pad = -len(rows) % n_dev  # whole rows of <pad> are fully masked
    padded = np.concatenate([rows, np.zeros((pad, rows.shape[1]), np.int32)])
    nats, count = jax.device_get(steps.eval(params, steps.shard_batch(padded, 0)))
    total = float(nats.sum())
    return {"loss": total / max(float(count.sum()), 1.0),
            "bits_per_byte": total / math.log(2) / max(data.eval_bytes(rows), 1),
            "tokens": int(count.sum()), "loss_by_position": (nats / np.maximum(count, 1)).tolist()}


def _peak_flops(devices: list) -> float | None:
    kind = devices[0].device_kind
    for name, tflops in PEAK_TFLOPS.items():
        if name in kind:
            return tflops * 1e12 * len(devices)
    return None


def _compile_checked(steps: Steps, params, opt_state, batch, tc: TrainConfig):
    """Compile the step once; refuse at once if it needs more device memory than there is."""
    compiled = steps.train.lower(params, opt_state, batch).compile()
    stats = steps.devices[0].memory_stats() or {}
    mem = compiled.memory_analysis()
    if mem is None or "bytes_limit" not in stats:
        return compiled
    need = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    if need > stats["bytes_limit"]:
        raise ValueError(f"batch_size={tc.batch_size} (grad_accum={tc.grad_accum}, seq_len={tc.seq_len}) "
                         f"needs {need / 2**30:.1f} GiB per device, more than the "
                         f"{stats['bytes_limit'] / 2**30:.1f} GiB there: raise grad_accum "
                         "or lower batch_size")
    return compiled


def _batch(steps: Steps, data: Dataset, tc: TrainConfig, step: int) -> jax.Array:
    rows = data.train_rows[batch_indices(len(data.train_rows), tc.batch_size, step, tc.seed)]
    return steps.shard_batch(rows.reshape(tc.grad_accum, tc.micro_batch, -1), 1)


def train(cfg: ModelConfig, tc: TrainConfig, data: Dataset, run_dir: str | Path, *,
          stop_at: int | None = None, max_seconds: float | None = None, quiet: bool = False,
          export: bool = True, export_dtype: str = "float32", devices: list | None = None,
          init: Params | None = None, init_from: str | None = None) -> TrainResult:
    """Train (resuming from run_dir/checkpoints if present) up to tc.steps.

    `stop_at` ends the run after that step and `max_seconds` after the step that
    crosses that much training time (both checkpoint where they stop); the model is
    exported when the run reaches tc.steps, or stops on `max_seconds`. `devices`
    (default: all) is the data-parallel mesh; the result does not depend on it
    beyond f32 reduction order. `init` (f32 parameters, e.g. of an exported model:
    `checkpoint.load_init_params`) replaces the random initialisation of a fresh run;
    the optimizer state starts fresh. A run that resumes from its checkpoints ignores it.
    `init_from` names where `init` came from, for the log.
    """
    run_dir = Path(run_dir)
    steps = make_steps(cfg, tc, devices)
    params = steps.replicate(init if init is not None else init_params(cfg, tc.seed))
    opt_state = steps.replicate(steps.tx.init(params))
    ckpts = TrainCheckpoints(run_dir / "checkpoints")
    start = ckpts.latest_step() or 0
    if start:
        params, opt_state = ckpts.restore(start, params, opt_state)
    steps.train = _compile_checked(steps, params, opt_state, _batch(steps, data, tc, start), tc)
    flops = model_flops_per_token(cfg, params, tc.seq_len)
    log = RunLog(run_dir / "train_log.jsonl", total_steps=tc.steps, quiet=quiet)
    log.record("start", step=start, train=tc.to_dict(), model=cfg.to_dict(), params=param_count(params),
               flops_per_token=flops, num_devices=len(steps.devices), init_from=init_from,
               devices=[str(d) for d in steps.devices],
               corpus={k: v for k, v in data.manifest.items() if k != "files"})
    log.message(_devices_line(steps.devices, tc))
    if start:
        log.message(f"resuming from step {start} ({run_dir / 'checkpoints'})")
    elif init is not None:
        log.message(f"starting from the parameters of {init_from or 'the given model'}")
    end = min(tc.steps, stop_at or tc.steps)
    result = _loop(steps, params, opt_state, data, tc, ckpts, log, start, end, flops, max_seconds)
    if export and (result.step == tc.steps or result.stopped_early):
        export_model(cfg, jax.device_get(result.params), run_dir / "model",
                     tokenizer_file=data.tokenizer_file, dtype=jnp.dtype(export_dtype))
        (run_dir / "model" / "corpus.json").write_text((run_dir / "corpus.json").read_text())
    ckpts.close()
    log.close()
    return result


def _devices_line(devices: list, tc: TrainConfig) -> str:
    n = len(devices)
    kind = devices[0].device_kind if devices else "?"
    if n == 1:
        return f"training on 1 device ({kind})"
    return (f"training on {n} devices ({kind}), data parallel: {tc.micro_batch // n} sequences per "
            f"device per micro-step, {tc.grad_accum} micro-step(s) per optimizer step")


def _loop(steps, params, opt_state, data, tc, ckpts, log, start, end, flops, max_seconds) -> TrainResult:
    peak = _peak_flops(steps.devices)
    t0 = t_mark = time.perf_counter()
    s_mark, t_first, ev, rates, early = start, None, None, [], False
    for step in range(start, end):
        params, opt_state, metrics = steps.train(params, opt_state, _batch(steps, data, tc, step))
        done = step + 1
        if done % tc.log_every == 0 or done == end:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            now = time.perf_counter()
            rate = (done - s_mark) * tc.tokens_per_step / (now - t_mark)
            if t_first is not None:  # the first interval holds the compilation
                rates.append(rate)
            t_first = t_first or now
            t_mark, s_mark = now, done
            lr = float(schedule(tc)(done))
            log.record("train", step=done, tokens_per_s=rate, lr=lr, **m)
            log.progress(done, m["loss"], rate, (tc.steps - done) * tc.tokens_per_step / max(rate, 1e-9))
        if max_seconds is not None and done < end and time.perf_counter() - t0 > max_seconds:
            early, end = True, done
            log.message(f"stopping after step {done}: max_seconds={max_seconds} reached")
        if done % tc.eval_every == 0 or done == end:
            ev = evaluate(steps, params, data, tc)
            if ev is not None:
                log.record("eval", step=done, **ev)
                log.message(f"step {done}: held-out loss {ev['loss']:.4f} nats/token, "
                            f"{ev['bits_per_byte']:.4f} bits/byte")
        if done % tc.ckpt_every == 0 or done == end:
            ckpts.save(done, params, opt_state)
        if early:
            break
    ckpts.wait()
    tps = float(np.median(rates)) if rates else None
    mfu = tps * flops / peak if (tps and peak) else None
    log.record("end", step=end, tokens_per_s=tps, mfu=mfu, stopped_early=early,
               seconds=time.perf_counter() - t0,
               eval={k: v for k, v in (ev or {}).items() if k != "loss_by_position"})
    return TrainResult(params, end, ev, tps, mfu, early)

