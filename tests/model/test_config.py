"""ModelConfig validation: bad values are rejected with messages that name them."""

from __future__ import annotations

import math

import pytest

from hybrid_jax.config import (
    AttentionConfig,
    LayerSpec,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
    RGLRUConfig,
)
from hybrid_jax.presets import load_preset, preset_names

ATT = AttentionConfig(4, 2, 16)
MAMBA = Mamba2Config(4, 16, 8)


def model(**kw):
    base = dict(architecture="native", vocab_size=64, hidden_size=32,
                layers=(LayerSpec("hybrid", 8),), attention=ATT, mamba2=MAMBA)
    return ModelConfig(**(base | kw))


@pytest.mark.parametrize("make,match", [
    (lambda: LayerSpec("mamba2", 8), "window=8 given for a mamba2 layer"),
    (lambda: LayerSpec("attention", 0), "window=0 must be >= 1"),
    (lambda: LayerSpec("transformer"), "'transformer' is not a valid LayerKind"),
    (lambda: AttentionConfig(6, 4, 16), "num_heads=6 must be a multiple of num_kv_heads=4"),
    (lambda: AttentionConfig(4, 2, 16, rotary_dim=7), "rotary_dim=7 must be even"),
    (lambda: AttentionConfig(4, 2, 0), "head_dim=0 must be > 0"),
    (lambda: AttentionConfig(4, 2, 16, softcap=-1.0), "softcap=-1.0 must be > 0"),
    (lambda: Mamba2Config(6, 16, 8, n_groups=4), "num_heads=6 must be a multiple of n_groups=4"),
    (lambda: Mamba2Config(4, 16, 8, dt_limit=(1.0, 0.5)), r"dt_limit=\(1.0, 0.5\)"),
    (lambda: Mamba2Config(4, 16, 8, in_proj_multipliers=(1.0, 1.0)), "in_proj_multipliers"),
    (lambda: RGLRUConfig(30, 4), "width=30 must be a multiple of num_heads=4"),
    (lambda: MLPConfig(64, activation="relu"), "activation='relu'"),
    (lambda: model(vocab_size=0), "vocab_size=0 must be > 0"),
    (lambda: model(layers=()), "layers=()"),
    (lambda: model(attention=None), "attention=None but the layer pattern has attention layers"),
    (lambda: model(mamba2=None), "mamba2=None"),
    (lambda: model(layers=(LayerSpec("rglru"),)), "rglru=None"),
    (lambda: model(eos_token_ids=(64,)), "eos_token_ids contains 64"),
    (lambda: model(logits_softcap=0.0), "logits_softcap=0.0 must be > 0"),
])
def test_invalid_values_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_from_dict_rejects_unknown_fields():
    d = model().to_dict()
    d["hiden_size"] = 3
    with pytest.raises(ValueError, match="hiden_size"):
        ModelConfig.from_dict(d)
    d = model().to_dict()
    d["mamba2"]["stat_size"] = 3
    with pytest.raises(ValueError, match="stat_size"):
        ModelConfig.from_dict(d)


def test_round_trip_keeps_infinity_and_pattern():
    cfg = model(layers=(LayerSpec("hybrid", 8), LayerSpec("mamba2"), LayerSpec("attention")))
    back = ModelConfig.from_dict(cfg.to_dict())
    assert back == cfg
    assert math.isinf(back.mamba2.dt_limit[1])
    assert back.windows == (8, None)


@pytest.mark.parametrize("name", preset_names())
def test_presets_load_and_validate(name):
    cfg = load_preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    if name == "native-1b-full-attention":  # the transformer baseline of the benchmarks
        assert cfg.windows == (None,) and cfg.mamba2 is None
    elif cfg.architecture == "native":
        assert any(s.kind.has_attention and s.window for s in cfg.layers)


def test_unknown_preset_lists_available():
    with pytest.raises(ValueError, match="native-tiny"):
        load_preset("no-such-model")
