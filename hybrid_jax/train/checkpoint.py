"""Training checkpoints (orbax CheckpointManager) and the final native export.

A training checkpoint holds the f32 master parameters and the optimizer state at an
optimizer step; with the data order a function of (seed, step), restoring one and
continuing gives exactly the parameters of an uninterrupted run. The export is a
native model directory (`hybrid_jax.checkpoints.native`) that `load_model` reads.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from hybrid_jax.checkpoints.native import is_native_dir, load_native, save_native
from hybrid_jax.config import ModelConfig
from hybrid_jax.model import CausalLM
from hybrid_jax.train.step import Params, init_params


class TrainCheckpoints:
    """Save/restore {params, opt_state} every N steps under `directory`, keeping the last `keep`."""

    def __init__(self, directory: str | Path, *, keep: int = 2):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).absolute(), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Params, opt_state) -> None:
        self.manager.save(step, args=ocp.args.StandardSave({"params": params, "opt_state": opt_state}))

    def restore(self, step: int, params: Params, opt_state) -> tuple[Params, object]:
        """Restore into the structure (and shardings) of `params` and `opt_state`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state})
        got = self.manager.restore(step, args=ocp.args.StandardRestore(target))
        return got["params"], got["opt_state"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()


def export_model(cfg: ModelConfig, params: Params, path: str | Path, *, tokenizer_file: str | Path,
                 dtype: jnp.dtype = jnp.float32) -> None:
    """Write a native model directory (config, parameters in `dtype`, tokenizer.json)."""
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    dtypes = jax.tree.map(lambda x: x.dtype, nnx.to_pure_dict(state))
    cast = jax.tree.map(lambda x, d: jnp.asarray(x, d), params, dtypes)
    save_native(nnx.merge(graphdef, cast), path, tokenizer_file=tokenizer_file)


def load_init_params(path: str | Path, cfg: ModelConfig) -> Params:
    """f32 parameters of an exported native model, to start a new run from (`--init-from`).

    The model's config must equal the run's `cfg` (same shapes, same tokenizer size);
    a bf16 export is widened to f32 master weights. Raises ValueError naming init_from.
    """
    if not is_native_dir(path):
        raise ValueError(f"init_from={str(path)!r} is not a native model directory "
                         "(no hybrid_jax_config.json)")
    model, saved = load_native(path, dtype=jnp.float32)
    if saved.to_dict() != cfg.to_dict():
        diff = sorted(k for k, v in cfg.to_dict().items() if saved.to_dict().get(k) != v)
        raise ValueError(f"init_from={str(path)!r} has another model config than this run "
                         f"(differs in: {', '.join(diff)})")
    _, state = nnx.split(model)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nnx.to_pure_dict(state))
    want = jax.eval_shape(lambda: init_params(cfg, 0))
    shapes = lambda t: jax.tree.map(lambda x: tuple(x.shape), t)
    if shapes(params) != shapes(want):
        raise ValueError(f"init_from={str(path)!r}: its parameter tree does not match the model config")
    return params
