"""Checkpoint loading: strict errors, sharded indexes, aliases, bf16, native orbax, tokenizers."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from hybrid_jax.checkpoints import CheckpointError, load_hf  # noqa: E402
from hybrid_jax.checkpoints.native import load_native, save_native  # noqa: E402
from hybrid_jax.loading import load_model  # noqa: E402
from hybrid_jax.model import CausalLM  # noqa: E402
from hybrid_jax.presets import load_preset  # noqa: E402
from hybrid_jax.tokenizer import Tokenizer  # noqa: E402
from tests.model.hf_models import build  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 128, (1, 40)).astype(np.int32)


def logits(model) -> np.ndarray:
    return np.asarray(model(jnp.asarray(IDS)))


def test_missing_unexpected_and_misshaped_are_listed_together(tmp_path):
    build("mistral", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(7, 64)
    tensors["model.layers.0.self_attn.rotary.inv_freq"] = torch.zeros(4)
    save_file(tensors, file)
    with pytest.raises(CheckpointError) as err:
        load_hf(tmp_path)
    e = err.value
    assert e.missing == ["model.layers.1.mlp.up_proj.weight"]
    assert e.unexpected == ["model.layers.0.self_attn.rotary.inv_freq"]
    assert len(e.misshaped) == 1 and "q_proj.weight (64, 7)" in e.misshaped[0]
    for part in ("missing (1)", "unexpected (1)", "mis-shaped (1)"):
        assert part in str(e)


def test_sharded_checkpoint_equals_single_file(tmp_path):
    model = build("falcon_h1", tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, _ = load_hf(tmp_path / "one")
    sharded, _ = load_hf(tmp_path / "sharded")
    np.testing.assert_array_equal(logits(one), logits(sharded))


def test_mamba2_original_embedding_name_is_accepted(tmp_path):
    build("mamba2", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    tensors["backbone.embedding.weight"] = tensors.pop("backbone.embeddings.weight")
    save_file(tensors, file)
    model, _ = load_hf(tmp_path)
    assert np.isfinite(logits(model)).all()


def test_bf16_load_is_close_to_f32(tmp_path):
    build("recurrent_gemma", tmp_path)
    f32, _ = load_hf(tmp_path, dtype=jnp.float32)
    bf16, _ = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert bf16.embed.embedding[...].dtype == jnp.bfloat16
    a, b = logits(f32), logits(bf16)
    assert np.abs(a - b).max() / np.abs(a).max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.8


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"],
                                                      "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf(tmp_path)


def test_native_orbax_round_trip(tmp_path):
    cfg = load_preset("native-tiny")
    model = CausalLM(cfg, rngs=nnx.Rngs(7))
    save_native(model, tmp_path / "ckpt")
    back, back_cfg = load_native(tmp_path / "ckpt")
    assert back_cfg == cfg
    ids = jnp.asarray(IDS % cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(back(ids)))
    loaded = load_model(str(tmp_path / "ckpt"))
    assert loaded.source == "native" and loaded.tokenizer is not None


def test_tokenizer_from_hf_style_file_round_trips(tmp_path):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hybrid models mix state space and attention"] * 20,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer.from_file(tmp_path, bos_id=1)
    ids = t.encode("hybrid models", add_bos=True)
    assert ids[0] == 1 and t.decode(ids[1:]).replace(" ", "") == "hybridmodels"


def test_byte_level_tokenizer_handles_multibyte_text():
    lm = load_model("native-tiny")
    text = "naïve 世界 🙂"
    ids = lm.tokenizer.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < lm.config.vocab_size
    assert lm.tokenizer.decode(ids) == text


def test_preset_for_the_host_is_drawn_where_it_can_be_and_moved_whole(monkeypatch):
    """Tensor parallelism asks for a preset on the host; with an accelerator that fits it,
    it is drawn there and moved (hybrid_jax/loading.py). Here (CPU only) the host draws it,
    and a move onto the device the leaves are already on keeps every value (nothing freed)."""
    import jax

    from hybrid_jax import loading

    cpu = jax.devices("cpu")[0]
    assert loading._preset_maker("native-tiny", "float32", cpu) is None  # no accelerator here
    assert loading._preset_maker("/no/such/dir", "float32", cpu) is None
    on_host = load_model("native-tiny", device=cpu)
    plain = load_model("native-tiny")
    for a, b in zip(jax.tree.leaves(nnx.state(on_host.model)), jax.tree.leaves(nnx.state(plain.model)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(plain.model))]
    moved = loading._moved(plain, cpu)
    after = jax.tree.leaves(nnx.state(moved.model))
    assert all(x.devices() == {cpu} for x in after)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
