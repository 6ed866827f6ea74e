"""Mamba1 models (Mamba, Falcon-Mamba, Jamba) against transformers, and their loaders' refusals.

Logits over 40 tokens of tiny random models (tests/model/hf_models.py) in f32:
max |ours - hf| / max |hf| <= 1e-4. Falcon-Mamba checks the weightless dt/B/C norms, Jamba
the weighted ones with attention and softmax-routed experts, plain Mamba no norms and an
untied head. The engine runs Jamba in tests/serving/test_mamba1_engine.py.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.checkpoints import load_hf  # noqa: E402
from hybrid_jax.checkpoints.hf import CheckpointError  # noqa: E402
from hybrid_jax.config import ModelConfig  # noqa: E402
from tests.model.hf_models import build  # noqa: E402


@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "jamba"])
def test_logits_match_transformers(arch, tmp_path):
    hf_model = build(arch, tmp_path, seed=1)
    model, cfg = load_hf(tmp_path)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_loader_reports_missing_unexpected_and_misshaped_together(tmp_path):
    from safetensors.numpy import load_file, save_file

    build("jamba", tmp_path / "a", seed=0)
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    del tensors["model.layers.0.mamba.dt_layernorm.weight"]
    tensors["model.layers.0.mamba.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.layers.2.mamba.A_log"] = np.zeros((64, 4), np.float32)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file(tensors, tmp_path / "b" / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path / "b")
    e = err.value
    assert e.missing == ["model.layers.0.mamba.dt_layernorm.weight"]
    assert e.unexpected == ["model.layers.0.mamba.extra.weight"]
    assert len(e.misshaped) == 1 and "model.layers.2.mamba.A_log" in e.misshaped[0]
    # A Mamba config with another activation is refused naming the field.
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg | {"hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        load_hf(tmp_path / "a")
