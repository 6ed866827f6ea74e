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
from hybrid_jax.quantization import check_quantization, quantize_model
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
    `quantization`: "fp8" quantizes the decoder Linears block-wise as they load
    (hybrid_jax/quantization.py); an FP8 checkpoint loads FP8 either way.
    """
    check_quantization(quantization)
    if device is not None:
        with jax.default_device(device):
            return load_model(model, dtype=dtype, seed=seed, quantization=quantization)
    lm = _load(model, dtype, seed)
    quantize_model(lm.model, quantization)
    return lm


def _load(model: str, dtype: str, seed: int) -> LoadedModel:
    dt = _dtype(dtype)
    model = resolve_model_name(model)
    path = Path(model)
    if path.is_dir() and is_native_dir(path):
        m, cfg = load_native(path, dtype=dt)
        return LoadedModel(m, cfg, _tokenizer_in(path, cfg) or _maybe_bytes(cfg), "native")
    if path.is_dir() and (path / "config.json").is_file():
        m, cfg = load_hf(path, dtype=dt)
        return LoadedModel(m, cfg, _tokenizer_in(path, cfg), "hf")
    if model in preset_names():
        cfg = load_preset(model)
        m = CausalLM(cfg, dtype=dt, rngs=nnx.Rngs(seed))
        return LoadedModel(m, cfg, _maybe_bytes(cfg), "preset")
    raise ValueError(f"model={model!r} is neither a model directory, {DEFAULT_MODEL!r} nor a preset "
                     f"({', '.join(preset_names())})")


def _maybe_bytes(cfg: ModelConfig) -> Tokenizer | None:
    return byte_tokenizer(cfg) if cfg.architecture == "native" else None
