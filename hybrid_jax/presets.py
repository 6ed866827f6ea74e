"""Model presets shipped as plain JSON data in `configs/models/` (ModelConfig.to_dict form)."""

from __future__ import annotations

import json
from importlib import resources

from hybrid_jax.config import ModelConfig


def preset_names() -> tuple[str, ...]:
    root = resources.files("configs") / "models"
    return tuple(sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json")))


def load_preset(name: str) -> ModelConfig:
    """The ModelConfig of preset `name`; ValueError listing the presets if unknown."""
    if name not in preset_names():
        raise ValueError(f"unknown preset {name!r}; available: {', '.join(preset_names())}")
    text = (resources.files("configs") / "models" / f"{name}.json").read_text()
    return ModelConfig.from_dict(json.loads(text))
