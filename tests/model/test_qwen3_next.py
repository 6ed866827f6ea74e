"""Qwen3-Next / Qwen3.5: teacher-forced logits against transformers, strict loading, the
MTP head and vision tower set aside, config round trip.

References are transformers' tiny random models (tests/model/hf_models.py): Qwen3-Next
(grouped fused Gated DeltaNet projections, MoE with a gated shared expert, one dense
layer), Qwen3.5 dense (projections apart), and the multimodal Qwen3.5-MoE checkpoint
layout (text under `text_config`, tensors `model.language_model.*`, a vision tower), on
test_hf_parity's sequences (the last has one ill-conditioned position, checked against
transformers' float64 forward: tests/model/hf_models.py `check_ill_conditioned`). The
serving path (slot-indexed conv and rule kernels, chunked prefill, decode, verification)
is checked through the engine in tests/serving/test_gated_deltanet_engine.py.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.checkpoints import CheckpointError, load_hf  # noqa: E402
from hybrid_jax.checkpoints.qwen3_next import mtp_tensors  # noqa: E402
from hybrid_jax.config import LayerKind, ModelConfig  # noqa: E402
from tests.model import hf_models  # noqa: E402

ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe_vlm")


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, tmp_path):
    hf_model = hf_models.build(arch, tmp_path, seed=0)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    # An MTP head as the published checkpoints ship it: set aside, not loaded.
    mtp = {"mtp.fc.weight": np.ones((64, 128), np.float32), "mtp.norm.weight": np.zeros(64, np.float32)}
    save_file(tensors | mtp, file, metadata={"format": "pt"})
    model, cfg = load_hf(tmp_path)
    kinds = {s.kind for s in cfg.layers}
    assert kinds == {LayerKind.GATED_DELTANET, LayerKind.ATTENTION}
    assert cfg.attention.output_gate and cfg.attention.rope_dim == 4 and cfg.norm_offset
    assert cfg.gated_deltanet.grouped_projections == (arch == "qwen3_next")
    assert any(s.moe for s in cfg.layers) == (arch != "qwen3_5")
    if arch == "qwen3_5_moe_vlm":
        assert any(n.startswith("model.visual.") for n in tensors)
    got = mtp_tensors(tmp_path)
    assert got.keys() == mtp.keys() and all(np.array_equal(got[k], mtp[k]) for k in mtp)
    # test_hf_parity's model and sequences (its generic run leaves these architectures out)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 80))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))
    if np.abs(ours - ref).max() / np.abs(ref).max() > hf_models.TOL:
        assert arch == "qwen3_5_moe_vlm"  # its known ill-conditioned position (row 0, 62)
        hf_models.check_ill_conditioned(arch, hf_model, ids, ours, ref)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_strict_loading_reports_everything(tmp_path):
    hf_models.build("qwen3_5", tmp_path, seed=0)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.0.linear_attn.A_log"]
    tensors["model.layers.1.self_attn.q_proj.weight"] = tensors["model.layers.1.self_attn.q_proj.weight"][:64]
    tensors["model.layers.2.linear_attn.extra.weight"] = np.zeros(3, np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    e = err.value
    assert e.missing == ["model.layers.0.linear_attn.A_log"]
    assert e.unexpected == ["model.layers.2.linear_attn.extra.weight"]
    assert len(e.misshaped) == 1 and "q_proj" in e.misshaped[0]


def test_bad_configs_are_refused_by_name():
    from hybrid_jax.checkpoints.qwen3_next import config_from_hf
    from hybrid_jax.config import GatedDeltaNetConfig, LayerSpec

    with pytest.raises(ValueError, match="num_v_heads=6 must be a multiple of num_k_heads=4"):
        GatedDeltaNetConfig(num_k_heads=4, num_v_heads=6, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ValueError, match="gated_deltanet=None"):
        ModelConfig(architecture="t", vocab_size=8, hidden_size=8, layers=(LayerSpec("gated_deltanet"),))
    hf = hf_models.qwen3_5_config().to_dict() | {"architectures": ["Qwen3_5ForCausalLM"]}
    with pytest.raises(ValueError, match="layer_types=\\['sliding_attention'\\]"):
        config_from_hf(hf | {"layer_types": ["sliding_attention"] + hf["layer_types"][1:]})
