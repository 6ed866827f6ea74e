"""Presets as plain data: model shapes in `models/*.json` (ModelConfig.to_dict form),
and the shipped default model (`default_model/`).
"""

from pathlib import Path

# The model that `hybrid-jax generate`, `serve` and `LLM()` load when none is named: a
# small native hybrid trained on Python source (docs/training.md), shipped here as data.
DEFAULT_MODEL = "default"


def default_model_dir() -> Path:
    """The shipped default model's directory (a native checkpoint with tokenizer.json)."""
    return Path(__file__).parent / "default_model"


def resolve_model_name(model: str) -> str:
    """`DEFAULT_MODEL` -> the shipped model's directory; any other name unchanged. No JAX."""
    return str(default_model_dir()) if model == DEFAULT_MODEL else model
