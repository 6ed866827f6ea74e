"""Load Hugging Face checkpoint directories (config.json + safetensors, sharded or not).

Loading refuses to guess: the per-architecture name map must account for every
tensor in the files and every parameter of the model; missing, unexpected and
mis-shaped tensors are reported together in one `CheckpointError`. The model is
built abstractly (no random init) and filled from the files in bf16 or f32.
This module knows nothing of serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import safe_open

from hybrid_jax.checkpoints import (
    bamba,
    falcon_h1,
    gemma2,
    gemma3,
    gemma3_vlm,
    granite_hybrid,
    lfm2,
    lfm2_moe,
    mamba2,
    mistral,
    nemotron_h,
    recurrent_gemma,
    zamba2,
)
from hybrid_jax.checkpoints.names import Target
from hybrid_jax.config import ModelConfig
from hybrid_jax.model import CausalLM

_MODULES: tuple[ModuleType, ...] = (mamba2, mistral, recurrent_gemma, falcon_h1, zamba2, lfm2,
                                    gemma3, gemma2, bamba, granite_hybrid, nemotron_h,
                                    gemma3_vlm, lfm2_moe)
_BY_ARCH = {m.ARCHITECTURE: m for m in _MODULES}
# Known architectures whose math is not implemented: refused naming what is missing.
_UNSUPPORTED = {
    "JambaForCausalLM": "the Mamba1 selective scan and mixture-of-experts layers",
    "MambaForCausalLM": "the Mamba1 selective scan",
    "FalconMambaForCausalLM": "the Mamba1 selective scan",
    "Qwen3NextForCausalLM": "Gated DeltaNet and mixture-of-experts layers",
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: every problem listed at once."""

    def __init__(self, path: str, missing: list[str], unexpected: list[str],
                 misshaped: list[str]):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        parts = [f"checkpoint {path} does not match the model:"]
        for title, items in (("missing", missing), ("unexpected", unexpected),
                             ("mis-shaped", misshaped)):
            if items:
                parts.append(f"  {title} ({len(items)}): " + ", ".join(items))
        super().__init__("\n".join(parts))


def supported_architectures() -> tuple[str, ...]:
    return tuple(_BY_ARCH)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face model directory")
    return json.loads(cfg_file.read_text())


def _module_for(hf: dict[str, Any]) -> ModuleType:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _UNSUPPORTED:
            raise ValueError(f"architectures={archs} needs {_UNSUPPORTED[arch]}, which "
                             "hybrid-jax does not implement")
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    by_type = {m.__name__.rsplit(".", 1)[-1]: m for m in _MODULES}
    if hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise ValueError(f"architectures={archs} / model_type={hf.get('model_type')!r} is not "
                     f"supported; supported: {supported_architectures()}")


def _tensor_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            out |= dict.fromkeys(f.keys(), file)
    return out


def _shape_after(transform: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if transform == "linear":
        return tuple(reversed(shape))
    if transform == "experts" and len(shape) == 3:
        return (shape[0], shape[2], shape[1])
    if transform == "conv" and len(shape) == 3 and shape[1] == 1:
        return (shape[0], shape[2])
    return shape


def _part_shape(shape: tuple[int, ...], index) -> tuple[int, ...]:
    """The shape of `param[index]` for a parameter of `shape` (no data touched)."""
    return shape if index is None else np.broadcast_to(np.float32(0), shape)[index].shape


def _apply(transform: str, x: jax.Array) -> jax.Array:
    if transform == "linear":
        return x.T
    if transform == "experts":
        return jnp.swapaxes(x, 1, 2)
    if transform == "conv":
        return x[:, 0, :]
    return x


def _read_shape(file: Path, name: str) -> tuple[int, ...]:
    with safe_open(file, framework="flax") as f:
        return tuple(f.get_slice(name).get_shape())


def _plan(path: Path, files: dict[str, Path], wmap: dict[str, Target], aliases: dict[str, str],
          expected: dict[tuple, jax.ShapeDtypeStruct]) -> dict[str, str]:
    """Check names and shapes; return canonical HF name -> name in the files."""
    present = {aliases.get(n, n): n for n in files}
    missing = sorted(set(wmap) - set(present))
    unexpected = sorted(present[n] for n in set(present) - set(wmap))
    misshaped = []
    for name in sorted(set(wmap) & set(present)):
        target = wmap[name]
        shape = _shape_after(target.transform, _read_shape(files[present[name]], present[name]))
        want = _part_shape(tuple(expected[target.path].shape), target.index)
        if shape != want:
            where = ".".join(map(str, target.path))
            misshaped.append(f"{present[name]} {shape} (expected {want} for {where})")
    if missing or unexpected or misshaped:
        raise CheckpointError(str(path), missing, unexpected, misshaped)
    return present


def load_hf(path: str | Path, *, dtype: jnp.dtype = jnp.float32) -> tuple[CausalLM, ModelConfig]:
    """Load an HF directory into a `CausalLM` with parameters in `dtype` (bf16 or f32).

    Parameters the model keeps in f32 whatever `dtype` (A_log, D, dt_bias) stay f32.
    """
    path = Path(path)
    hf = read_hf_config(path)
    module = _module_for(hf)
    cfg = module.config_from_hf(hf)
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    wmap = module.weight_map(cfg)
    unmapped = set(expected) - {t.path for t in wmap.values()}
    assert not unmapped, f"name map of {module.ARCHITECTURE} misses params {sorted(unmapped)}"
    files = _tensor_files(path)
    if hasattr(module, "skipped"):  # tensors of parts not served (a vision tower)
        files = {n: f for n, f in files.items() if not module.skipped(n)}
    if hasattr(module, "tied_copies"):  # stored copies of tied weights (Zamba2's shared blocks)
        copies = module.tied_copies(cfg)
        files = {n: f for n, f in files.items() if n not in copies}
    aliases = dict(getattr(module, "ALIASES", {}))
    if hasattr(module, "canonical_name"):  # e.g. a renamed trunk prefix
        aliases = {n: module.canonical_name(n) for n in files} | aliases
    _check_parts(module.ARCHITECTURE, wmap, expected)
    present = _plan(path, files, wmap, aliases, expected)
    values: dict[tuple, jax.Array] = {}
    parts: dict[tuple, np.ndarray] = {}  # parameters filled piece by piece (Target.index)
    for name, target in wmap.items():
        stored = present[name]
        with safe_open(files[stored], framework="flax") as f:
            x = _apply(target.transform, f.get_tensor(stored))
        want = expected[target.path]
        if target.index is None:
            values[target.path] = jnp.asarray(x, want.dtype)
        else:
            if target.path not in parts:
                parts[target.path] = np.zeros(want.shape, np.dtype(want.dtype))
            parts[target.path][target.index] = np.asarray(x.astype(want.dtype))
    values |= {p: jnp.asarray(x) for p, x in parts.items()}
    pure = _nest(values)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state), cfg


def _check_parts(arch: str, wmap: dict[str, Target], expected) -> None:
    """A name map's pieces of one parameter (Target.index) must cover it exactly once."""
    covered: dict[tuple, int] = {}
    for t in wmap.values():
        if t.index is not None:
            covered[t.path] = covered.get(t.path, 0) + int(np.prod(
                _part_shape(tuple(expected[t.path].shape), t.index)))
    for p, n in covered.items():
        assert n == expected[p].size, f"name map of {arch}: pieces cover {n} of {p}'s {expected[p].size}"


def _nest(flat: dict[tuple, Any]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out
