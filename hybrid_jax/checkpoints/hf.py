"""Load Hugging Face checkpoint directories (config.json + safetensors, sharded or not).

Loading refuses to guess: the per-architecture name map must account for every
tensor in the files and every parameter of the model; missing, unexpected and
mis-shaped tensors are reported together in one `CheckpointError`. The model is
built abstractly (no random init) and filled from the files in bf16 or f32; the Linear
weights an FP8 checkpoint stores in float8_e4m3fn with block scales stay FP8
(hybrid_jax/checkpoints/fp8.py), and so do MoE experts stored one FP8 Linear each
(Qwen3.5-FP8): they are stacked, with their scales, into the layer's FP8 expert stacks
(`_fp8_stacks`). FP8 Linears held as (pieces of) other plain parameters, the router and
the shared-expert gate, are dequantized exactly at load (tiny).
This module knows nothing of serving.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open

from hybrid_jax.checkpoints import (
    bamba,
    falcon_h1,
    falcon_mamba,
    gemma2,
    gemma3,
    gemma3_vlm,
    granite_hybrid,
    jamba,
    kimi_linear,
    lfm2,
    lfm2_moe,
    mamba1,
    mamba2,
    mistral,
    nemotron_h,
    qwen3_next,
    recurrent_gemma,
    zamba2,
)
from hybrid_jax.checkpoints.fp8 import SCALE_SUFFIX, fp8_format, plan_fp8, read_fp8, stored_dtype
from hybrid_jax.checkpoints.mtp import PREFIX as MTP_PREFIX
from hybrid_jax.checkpoints.mtp import mtp_weight_map
from hybrid_jax.checkpoints.names import Target
from hybrid_jax.config import ModelConfig
from hybrid_jax.layers.fp8 import dequantize, quantize_experts
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.moe import MoE
from hybrid_jax.model import CausalLM
from hybrid_jax.quantization import FP8_BLOCK, check_quantization, quantize_kernel, quantizes
from pallas_kernels.grouped_gemm import scale_blocks

_MODULES: tuple[ModuleType, ...] = (mamba2, mistral, recurrent_gemma, falcon_h1, zamba2, lfm2,
                                    gemma3, gemma2, bamba, granite_hybrid, nemotron_h,
                                    gemma3_vlm, lfm2_moe, mamba1, falcon_mamba, jamba, qwen3_next,
                                    kimi_linear)
# A module serves its ARCHITECTURE, or every name in ARCHITECTURES (one family's classes).
_BY_ARCH = {a: m for m in _MODULES for a in getattr(m, "ARCHITECTURES", (m.ARCHITECTURE,))}
# Known architectures whose math is not implemented: refused naming what is missing.
_UNSUPPORTED: dict[str, str] = {}


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
    if transform == "heads" and len(shape) == 4 and shape[:2] + shape[3:] == (1, 1, 1):
        return (shape[2],)
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
    if transform == "heads":
        return x.reshape(-1)
    return x


def _read_shape(file: Path, name: str) -> tuple[int, ...]:
    with safe_open(file, framework="flax") as f:
        return tuple(f.get_slice(name).get_shape())


def _plan(path: Path, files: dict[str, Path], wmap: dict[str, Target], aliases: dict[str, str],
          expected: dict[tuple, jax.ShapeDtypeStruct], hf: dict[str, Any]
          ) -> tuple[dict[str, str], dict[str, str], int | None]:
    """Check names, shapes and FP8 scales; return (canonical HF name -> name in the files,
    canonical name of each FP8 weight -> its scale's name in the files, the FP8 block)."""
    fmt = fp8_format(hf)
    present = {aliases.get(n, n): n for n in files}
    scale_names = {n for n in present if n.endswith(".weight" + SCALE_SUFFIX)}
    missing = sorted(set(wmap) - set(present))
    unexpected = sorted(present[n] for n in set(present) - set(wmap) - scale_names)
    misshaped = []
    stored = {}
    for name in sorted(set(wmap) & set(present)):
        target, file = wmap[name], files[present[name]]
        raw = _read_shape(file, present[name])
        stored[name] = (present[name], stored_dtype(file, present[name]), raw)
        shape = _shape_after(target.transform, raw)
        want = _part_shape(tuple(expected[target.path].shape), target.index)
        if shape != want:
            where = ".".join(map(str, target.path))
            misshaped.append(f"{present[name]} {shape} (expected {want} for {where})")
    scale_files = {n: (present[n], stored_dtype(files[present[n]], present[n]),
                       _read_shape(files[present[n]], present[n])) for n in scale_names}
    linears = {n for n, t in wmap.items() if t.transform == "linear"}
    fp8 = plan_fp8(fmt, stored, linears, scale_files)
    missing += fp8.missing
    unexpected += fp8.unexpected
    misshaped += fp8.misshaped
    if missing or unexpected or misshaped:
        raise CheckpointError(str(path), missing, unexpected, misshaped)
    return present, fp8.scales, None if fmt is None else fmt.block


def load_hf(path: str | Path, *, dtype: jnp.dtype = jnp.float32,
            quantization: str | None = None) -> tuple[CausalLM, ModelConfig]:
    """Load an HF directory into a `CausalLM` with parameters in `dtype` (bf16 or f32).

    Parameters the model keeps in f32 whatever `dtype` (A_log, D, dt_bias) stay f32.
    `quantization="fp8"` of a checkpoint that is not FP8: each weight that
    hybrid_jax/quantization.py quantizes (`quantizes`) is quantized as soon as it is read
    (a stack filled piece by piece once complete), so the model is never on the device
    whole in `dtype`; the values `quantize_model` gives the loaded model. An FP8
    checkpoint loads as it is stored either way.
    """
    path = Path(path)
    hf = read_hf_config(path)
    module = _module_for(hf)
    cfg = module.config_from_hf(hf)
    files = _tensor_files(path)
    # The MTP head's tensors (speculative_method="mtp"; names from checkpoints/mtp.py) load
    # with the trunk's, checked and FP8-read by the same plan. A checkpoint whose config has
    # a head but whose files do not (a stripped re-upload) loads without one, and
    # speculative_method="mtp" is then refused by name; `mtp.*` tensors of a config without
    # a head are set aside (transformers ignores them too).
    mtp_names = {n for n in files if n.startswith(MTP_PREFIX)}
    if cfg.mtp_num_hidden_layers and not mtp_names:
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=0)
    if not cfg.mtp_num_hidden_layers:
        files = {n: f for n, f in files.items() if n not in mtp_names}
    abstract = nnx.eval_shape(lambda: CausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    expected = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(state)}
    if hasattr(module, "skipped"):  # tensors of parts not served (a vision tower)
        files = {n: f for n, f in files.items() if not module.skipped(n)}
    if hasattr(module, "tied_copies"):  # stored copies of tied weights (Zamba2's shared blocks)
        copies = module.tied_copies(cfg)
        copies |= {c + SCALE_SUFFIX for c in copies}  # and their FP8 scales
        files = {n: f for n, f in files.items() if n not in copies}
    aliases = dict(getattr(module, "ALIASES", {}))
    if hasattr(module, "canonical_name"):  # e.g. a renamed trunk prefix
        aliases = {n: module.canonical_name(n) for n in files} | aliases
    if getattr(module, "ARCHITECTURES", None):  # its map depends on how the files store a part
        wmap = module.weight_map(cfg, {aliases.get(n, n) for n in files})
    else:
        wmap = module.weight_map(cfg)
    if cfg.mtp_num_hidden_layers:
        wmap = wmap | mtp_weight_map(cfg, wmap)
    unmapped = set(expected) - {t.path for t in wmap.values()}
    assert not unmapped, f"name map of {module.ARCHITECTURE} misses params {sorted(unmapped)}"
    _check_parts(module.ARCHITECTURE, wmap, expected)
    present, scales, block = _plan(path, files, wmap, aliases, expected, hf)
    values: dict[tuple, jax.Array] = {}
    fp8: dict[tuple, tuple[jax.Array, jax.Array]] = {}
    parts: dict[tuple, np.ndarray] = {}  # parameters filled piece by piece (Target.index)
    pieces_left = Counter(t.path for t in wmap.values() if t.index is not None)
    stacks = _fp8_stacks(abstract, wmap, scales, expected, block)
    quantize = _quantizer(abstract, expected, quantization if block is None else None)
    quantized: dict[tuple, tuple[jax.Array, jax.Array]] = {}  # quantized as read (FP8_BLOCK)

    def place(where: tuple, x: jax.Array) -> None:
        if where in quantize:
            quantized[where] = quantize[where](x)  # x (in `dtype`) freed when the caller drops it
        else:
            values[where] = x

    for name, target in wmap.items():
        stored = present[name]
        want = expected[target.path]
        if name in scales:  # FP8 kernel [in, out] and its scales [ceil(in/B), ceil(out/B)]
            with safe_open(files[scales[name]], framework="flax") as f:
                scale = jnp.asarray(f.get_tensor(scales[name]).T)
            kernel = jnp.asarray(read_fp8(files[stored], stored).T)
            if isinstance(_module_at(abstract, target.path[:-1]), Linear):
                fp8[target.path] = (kernel, scale)
                continue
            if target.path in stacks:  # one expert's Linear into the FP8 stack, scales beside
                q, s, dtypes = stacks[target.path]
                q[target.index] = np.asarray(kernel)
                s[_scale_index(target, want.shape, block)] = np.asarray(scale.astype(jnp.float32))
                dtypes.add(jnp.dtype(scale.dtype))
                continue
            # A checkpoint Linear held as (a piece of) another plain parameter: a router, a
            # shared expert's gate. Dequantized once here, exactly (hybrid_jax/layers/fp8.py):
            # it stays in the load dtype, not FP8.
            x = dequantize(kernel, scale, block, want.dtype)
        else:
            with safe_open(files[stored], framework="flax") as f:
                x = _apply(target.transform, f.get_tensor(stored))
        if target.index is None:
            place(target.path, jnp.asarray(x, want.dtype))
        else:
            if target.path not in parts:
                parts[target.path] = np.zeros(want.shape, np.dtype(want.dtype))
            parts[target.path][target.index] = np.asarray(x.astype(want.dtype))
            pieces_left[target.path] -= 1
            if not pieces_left[target.path]:  # complete: to the device (host copy freed)
                place(target.path, jnp.asarray(parts.pop(target.path)))
    assert not parts, f"pieces left unfilled: {sorted(parts)}"
    pure = _nest(values)
    nnx.replace_by_pure_dict(state, pure)
    model = nnx.merge(graphdef, state)
    for where, (kernel, scale) in fp8.items():
        _module_at(model, where[:-1]).set_fp8(kernel, scale, block)
    for where, (q, s, dtypes) in stacks.items():  # bf16 scales stay bf16 (exact either way)
        sdt = dtypes.pop() if len(dtypes) == 1 else jnp.float32
        _module_at(model, where[:-1]).set_fp8(where[-1], jnp.asarray(q), jnp.asarray(s, sdt), block)
    for where, (kernel, scale) in quantized.items():
        module = _module_at(model, where[:-1])
        if isinstance(module, Linear):
            module.set_fp8(kernel, scale, FP8_BLOCK)
        else:
            module.set_fp8(where[-1], kernel, scale, FP8_BLOCK)
    return model, cfg


def _quantizer(abstract: CausalLM, expected: dict[tuple, jax.ShapeDtypeStruct],
               quantization: str | None) -> dict[tuple, Callable[[jax.Array], tuple[jax.Array, jax.Array]]]:
    """Parameter path -> how quantization="fp8" quantizes it (hybrid_jax/quantization.py's
    rule and quantizers): the kernels of the Linears and the MoE stacks it quantizes."""
    check_quantization(quantization)
    if quantization is None:
        return {}
    out = {}
    for path in expected:
        module = _module_at(abstract, path[:-1])
        if not quantizes(path[:-1], module):
            continue
        if isinstance(module, Linear) and path[-1] == "kernel":
            out[path] = functools.partial(quantize_kernel, block=FP8_BLOCK)
        elif isinstance(module, MoE) and path[-1] in MoE.STACKS:
            out[path] = functools.partial(quantize_experts, block=FP8_BLOCK, glu=path[-1] == "gate_up")
    return out


def _scale_index(target: Target, shape: tuple[int, ...], block: int) -> tuple | None:
    """Where one expert's Linear (Target.index (j, :, cols)) puts its block scales in its
    stack's scales [e, ceil(in/B), nb] (gate_up: the gate and up halves on their own block
    grids), or None when its columns do not start and end on that grid."""
    j, rows, cols = target.index
    width = shape[2] // 2 if target.path[-1] == "gate_up" else shape[2]
    start = cols.start or 0
    stop = cols.stop if cols.stop is not None else shape[2]
    part, off = divmod(start, width)
    end = (part + 1) * width  # the end of its half (of the stack when not gate_up)
    if rows != slice(None) or off % block or stop > end or (stop != end and (stop - start) % block):
        return None
    first = part * -(-width // block) + off // block
    return j, slice(None), slice(first, first + -(-(stop - start) // block))


def _fp8_stacks(abstract, wmap: dict[str, Target], scales: dict[str, str], expected, block: int | None
                ) -> dict[tuple, tuple[np.ndarray, np.ndarray, set]]:
    """The MoE expert stacks an FP8 checkpoint fills with FP8 Linears only, each piece on
    its scale grid, in layers whose every stack qualifies: path -> (e4m3 stack, f32 scales,
    the scales' stored dtypes). Other FP8 pieces of plain parameters are dequantized."""
    if block is None:
        return {}
    pieces: dict[tuple, list[bool]] = {}
    for name, t in wmap.items():
        if t.index is not None and t.path[-1] in MoE.STACKS and isinstance(
                _module_at(abstract, t.path[:-1]), MoE):
            ok = name in scales and _scale_index(t, tuple(expected[t.path].shape), block) is not None
            pieces.setdefault(t.path, []).append(ok)
    layers: dict[tuple, bool] = {}
    for p, oks in pieces.items():
        layers[p[:-1]] = layers.get(p[:-1], True) and all(oks)
    moe_stacks = lambda p: [n for n in MoE.STACKS if getattr(_module_at(abstract, p), n) is not None]
    out = {}
    for layer, ok in layers.items():
        if ok and all((*layer, n) in pieces for n in moe_stacks(layer)):
            for n in moe_stacks(layer):
                shape = tuple(expected[(*layer, n)].shape)
                e, k, nw = shape
                out[(*layer, n)] = (np.zeros(shape, ml_dtypes.float8_e4m3fn),
                                    np.ones((e, *scale_blocks(k, nw, block, n == "gate_up")), np.float32),
                                    set())
    return out


def _module_at(model: nnx.Module, path: tuple) -> nnx.Module:
    for key in path:
        model = model[key] if isinstance(key, int) else getattr(model, key)
    return model


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
