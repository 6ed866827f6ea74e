"""The MTP head's tensors (`mtp.*`): name map and strict loader, for any architecture.

Qwen3-Next / Qwen3.5 (and vLLM's DeepSeek-style MTP) store the head as
  mtp.fc.weight [d, 2d]                   (input: concat(embedding part, hidden part))
  mtp.pre_fc_norm_embedding.weight [d]
  mtp.pre_fc_norm_hidden.weight [d]
  mtp.layers.J.*                          (a decoder layer, named as the trunk's layers)
  mtp.norm.weight [d]
The decoder layers' names are derived from the architecture's own name map: the map of
the trunk's first layer of the head's kind (hybrid_jax/layers/mtp.py `mtp_layer_spec`),
its `<prefix>.I.` renamed `mtp.layers.J.`. So any architecture with a name map and an
`mtp_num_hidden_layers` in its config gets the head's loader for free. From a checkpoint
directory, hybrid_jax/checkpoints/hf.py adds `mtp_weight_map` to the trunk's map, so the
head's tensors are checked with the trunk's (one error for both) and FP8 weights with
their `weight_scale_inv` and `modules_to_not_convert` read as the trunk's; `load_mtp` fills
a head from tensors in memory. Loading refuses to guess: missing, unexpected and
mis-shaped tensors are reported together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.checkpoints.names import Target, WeightMap
from hybrid_jax.config import ModelConfig
from hybrid_jax.layers.mtp import mtp_layer_spec

PREFIX = "mtp."


def mtp_weight_map(cfg: ModelConfig, trunk: WeightMap) -> WeightMap:
    """HF name -> Target (paths inside the model: ("mtp", ...)) of the head's tensors.

    `trunk`: the architecture's name map of the whole model (its `weight_map(cfg)`)."""
    spec = mtp_layer_spec(cfg)
    donor = next((i for i, s in enumerate(cfg.layers) if s == spec), None)
    if donor is None:
        raise ValueError(f"mtp_num_hidden_layers={cfg.mtp_num_hidden_layers}: the model has no "
                         f"{spec.kind} layer (window {spec.window}) to take the MTP layer's names from")
    layer = {n: t for n, t in trunk.items() if t.path[:2] == ("layers", donor)}
    marker = f".{donor}."
    out: WeightMap = {
        f"{PREFIX}fc.weight": Target(("mtp", "fc", "kernel"), "linear"),
        f"{PREFIX}norm.weight": Target(("mtp", "norm", "weight"), "same"),
        f"{PREFIX}pre_fc_norm_embedding.weight": Target(("mtp", "pre_fc_norm_embedding", "weight"), "same"),
        f"{PREFIX}pre_fc_norm_hidden.weight": Target(("mtp", "pre_fc_norm_hidden", "weight"), "same"),
    }
    for j in range(cfg.mtp_num_hidden_layers):
        for name, t in layer.items():
            rest = name[name.index(marker) + len(marker):]
            out[f"{PREFIX}layers.{j}.{rest}"] = t._replace(path=("mtp", "layers", j, *t.path[2:]))
    return out


def load_mtp(model: nnx.Module, tensors: Mapping[str, Any], trunk: WeightMap, source: str = "") -> None:
    """Fill `model.mtp` (a CausalLM's head) from `tensors` (HF name -> array, torch layout).

    Raises CheckpointError (hybrid_jax/checkpoints/hf.py) listing every missing, unexpected
    and mis-shaped tensor at once."""
    from hybrid_jax.checkpoints.hf import CheckpointError, _apply, _part_shape, _shape_after

    if model.mtp is None:
        raise ValueError(f"{source or 'model'}: the config has mtp_num_hidden_layers=0, no MTP head to load")
    wmap = mtp_weight_map(model.cfg, trunk)
    state = nnx.state(model.mtp)
    expected = {("mtp", *p): v.get_value() for p, v in nnx.to_flat_state(state)}
    missing = sorted(set(wmap) - set(tensors))
    unexpected = sorted(set(tensors) - set(wmap))
    misshaped = []
    for name in sorted(set(wmap) & set(tensors)):
        t = wmap[name]
        shape = _shape_after(t.transform, tuple(np.shape(tensors[name])))
        want = _part_shape(tuple(expected[t.path].shape), t.index)
        if shape != want:
            misshaped.append(f"{name} {shape} (expected {want} for {'.'.join(map(str, t.path))})")
    if missing or unexpected or misshaped:
        raise CheckpointError(source or "mtp tensors", missing, unexpected, misshaped)
    values: dict[tuple, np.ndarray] = {}
    for name, t in wmap.items():
        want = expected[t.path]
        x = np.asarray(_apply(t.transform, jnp.asarray(tensors[name])).astype(want.dtype))
        if t.index is None:
            values[t.path] = x
        else:
            values.setdefault(t.path, np.zeros(want.shape, np.dtype(want.dtype)))[t.index] = x
    nested: dict = {}
    for path, x in values.items():
        node = nested
        for key in path[1:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = jnp.asarray(x)
    nnx.replace_by_pure_dict(state, nested)
    nnx.update(model.mtp, state)
