"""One entry point for every model source: an HF directory, a native (orbax) directory,
or a preset name (random weights from a seed, for tests, benchmarks and demos).

The engine and the CLI call `load_model`; it knows nothing of serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from configs import DEFAULT_MODEL, resolve_model_name
from hybrid_jax.checkpoints.hf import load_hf
from hybrid_jax.checkpoints.native import is_native_dir, load_native
from hybrid_jax.config import ModelConfig
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset, preset_names
from hybrid_jax.quantization import FP8_BLOCK, check_quantization, quantize_model
from hybrid_jax.tokenizer import Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    source: str


def _dtype(name: str) -> jnp.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r} must be one of {sorted(DTYPES)}")
    return DTYPES[name]


def _tokenizer_in(path: Path, cfg: ModelConfig) -> Tokenizer | None:
    file = path / "tokenizer.json"
    return Tokenizer.from_file(file, bos_id=cfg.bos_token_id) if file.is_file() else None


def byte_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """The byte-level tokenizer shipped in configs/tokenizers (native presets)."""
    file = resources.files("configs") / "tokenizers" / "byte-level.json"
    with resources.as_file(file) as f:
        tok = Tokenizer.from_file(f, bos_id=cfg.bos_token_id)
    if tok.vocab_size > cfg.vocab_size:
        raise ValueError(f"byte-level tokenizer needs vocab_size >= {tok.vocab_size}, "
                         f"model has {cfg.vocab_size}")
    return tok


def load_model(model: str = DEFAULT_MODEL, *, dtype: str = "float32", seed: int = 0,
               device: jax.Device | None = None, quantization: str | None = None) -> LoadedModel:
    """Load `model`: an HF dir (config.json), a native dir, a preset name, or "default"
    (the shipped model trained on Python source, configs/default_model).

    `device`: where the parameters are created (default: JAX's default device). Tensor
    parallelism loads on the host CPU, then puts each device's shard on that device only.
    `quantization`: "fp8" quantizes the decoder Linears and MoE expert stacks block-wise as
    they load (hybrid_jax/quantization.py): a preset's expert stacks as they are drawn, an
    HF checkpoint's tensors as they are read, so the whole model is never held in `dtype`;
    an FP8 checkpoint loads FP8 either way.
    """
    check_quantization(quantization)
    if device is not None:
        maker = _preset_maker(model, dtype, device, quantization)
        if maker is not None:  # a preset for the host: drawn on an accelerator, then moved
            return _moved(load_model(model, dtype=dtype, seed=seed, device=maker,
                                     quantization=quantization), device)
        with jax.default_device(device):
            return load_model(model, dtype=dtype, seed=seed, quantization=quantization)
    lm = _load(model, dtype, seed, quantization)
    quantize_model(lm.model, quantization)  # what is left: a preset's Linears (or nothing)
    return lm


def _preset_maker(model: str, dtype: str, device: jax.Device,
                  quantization: str | None = None) -> jax.Device | None:
    """The accelerator that draws a preset's random weights asked for on the host (tensor
    parallelism loads there): drawing 35B values on a host CPU takes minutes, on a GPU
    seconds, and the values are the ones a single-device engine draws on that GPU (the
    same seed, the same backend). None: not a preset, the host has no accelerator, or the
    whole model does not fit in the first one's free memory (then the host draws it)."""
    if device.platform != "cpu" or resolve_model_name(model) not in preset_names():
        return None
    accel = [d for d in jax.local_devices() if d.platform != "cpu"]
    if not accel:
        return None
    stats = accel[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    cfg = load_preset(resolve_model_name(model))
    shapes = nnx.eval_shape(lambda: CausalLM(cfg, dtype=_dtype(dtype), rngs=nnx.Rngs(0),
                                             fp8_experts=_fp8_experts(quantization)))
    need = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(shapes)))
    return accel[0] if need * 1.25 < free else None


def _moved(lm: LoadedModel, device: jax.Device) -> LoadedModel:
    """`lm`'s parameters moved to `device`, the accelerator's copies freed at once."""
    state = nnx.state(lm.model)
    leaves = jax.tree.leaves(state)
    moved = jax.device_put(state, device)
    jax.block_until_ready(moved)
    nnx.update(lm.model, moved)
    for x in leaves:
        if x.devices() != {device}:  # a leaf already there is shared by its move, not copied
            x.delete()
    return lm


def _fp8_experts(quantization: str | None) -> int | None:
    """The block a preset's expert stacks are quantized with as they are drawn."""
    return FP8_BLOCK if quantization == "fp8" else None


def _load(model: str, dtype: str, seed: int, quantization: str | None = None) -> LoadedModel:
    dt = _dtype(dtype)
    model = resolve_model_name(model)
    path = Path(model)
    if path.is_dir() and is_native_dir(path):
        m, cfg = load_native(path, dtype=dt)
        return LoadedModel(m, cfg, _tokenizer_in(path, cfg) or _maybe_bytes(cfg), "native")
    if path.is_dir() and (path / "config.json").is_file():
        m, cfg = load_hf(path, dtype=dt, quantization=quantization)
        return LoadedModel(m, cfg, _tokenizer_in(path, cfg), "hf")
    if model in preset_names():
        cfg = load_preset(model)
        # quantization="fp8": the expert stacks (most of a MoE's bytes) quantized as drawn,
        # one stack at a time in `dt`; the same draws and values as quantizing afterwards.
        m = CausalLM(cfg, dtype=dt, rngs=nnx.Rngs(seed), fp8_experts=_fp8_experts(quantization))
        return LoadedModel(m, cfg, _maybe_bytes(cfg), "preset")
    raise ValueError(f"model={model!r} is neither a model directory, {DEFAULT_MODEL!r} nor a preset "
                     f"({', '.join(preset_names())})")


def _maybe_bytes(cfg: ModelConfig) -> Tokenizer | None:
    return byte_tokenizer(cfg) if cfg.architecture == "native" else None
