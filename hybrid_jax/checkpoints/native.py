"""Native checkpoints: `hybrid_jax_config.json` (ModelConfig.to_dict) + orbax parameters.

Layout of a native directory:
  hybrid_jax_config.json   the ModelConfig as plain data
  params/                  orbax StandardCheckpointer of the parameter tree
  tokenizer.json           optional, copied from the source model
Restoring builds the model abstractly and restores straight into that structure,
so a checkpoint whose tree does not match the config fails loudly in orbax.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from hybrid_jax.config import ModelConfig
from hybrid_jax.model import CausalLM

CONFIG_FILE = "hybrid_jax_config.json"


def is_native_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def save_native(model: CausalLM, path: str | Path, *, tokenizer_file: str | Path | None = None) -> None:
    """Write `model` (its config and parameters) to a new directory `path`."""
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(model.cfg.to_dict(), indent=1))
    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", nnx.to_pure_dict(state))
    if tokenizer_file is not None:
        shutil.copy(tokenizer_file, path / "tokenizer.json")


def load_native(path: str | Path, *, dtype: jnp.dtype = jnp.float32) -> tuple[CausalLM, ModelConfig]:
    """Restore a directory written by `save_native`, parameters cast to `dtype`."""
    path = Path(path).absolute()
    cfg = ModelConfig.from_dict(json.loads((path / CONFIG_FILE).read_text()))
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    # Restore onto this process's default device (`jax.default_device`, which tensor
    # parallelism sets to the host CPU), whatever devices the checkpoint was saved from
    # (a model trained on a GPU loads on a CPU).
    default = jax.config.jax_default_device
    if isinstance(default, str):
        default = jax.devices(default)[0]
    device = jax.sharding.SingleDeviceSharding(default or jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                          nnx.to_pure_dict(state))
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(path / "params", target)
    nnx.replace_by_pure_dict(state, restored)
    return nnx.merge(graphdef, state), cfg
