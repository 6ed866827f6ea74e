"""Zamba2 and LFM2 through the engine: transformers' argmax, chunk-size invariance,
batched == solo (greedy and seeded) under preemption; config variants' logits; refusals;
the real-size presets (size, one forward with tiny overrides, listed by the CLI).

Tiny random models are built with transformers (tests/model/hf_models.py) and loaded
from disk. Prompts of 1, 3, 4, 16 and 30 tokens sit below, at and beyond the conv widths
(LFM2 3, Zamba2 4), the SSD chunk (16) and the KV page (8); prefill chunks of 1, 7 and
32 tokens split them differently across steps. transformers scores prompt + generated
tokens in one uncached forward (teacher forcing): wherever its top-1/top-2 logit gap
exceeds 1e-3, the engine's token must be its argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from hybrid_jax.checkpoints import lfm2, load_hf, zamba2  # noqa: E402
from hybrid_jax.loading import LoadedModel, load_model  # noqa: E402
from hybrid_jax.model import CausalLM  # noqa: E402
from hybrid_jax.presets import load_preset  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from tests.model.hf_models import build  # noqa: E402

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU: outside the quick subset (-m "not slow")

NEW = 8
GAP = 1e-3
PROMPT_LENS = (1, 3, 4, 16, 30)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module", params=("lfm2", "zamba2"))
def hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), build(request.param, path, seed=0)


def engine(source: str | LoadedModel, chunk: int) -> LLM:
    """Every engine here has the same shapes (one decode and one mixed bucket), so the
    persistent compilation cache serves all but the first of each model.

    9 global-attention pages (+ the dummy; one 64-token sequence needs 8): the prompts
    with their outputs need up to 15 at once, so some are preempted and recomputed.
    """
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=chunk,
                       max_model_len=64, page_size=8, num_pages=10, seq_buckets=(4,),
                       token_buckets=(32,))
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    return LLM.from_engine(LLMEngine(loaded, cfg, show_progress=False))


def prompts_for(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS]


def clear_gap_matches(hf_model, prompt: list[int], tokens: list[int]) -> int:
    """Positions with a clear gap; asserts the engine's token is transformers' argmax there."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].numpy()
    compared = 0
    for i, (row, tok) in enumerate(zip(logits, tokens, strict=True)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > GAP:
            compared += 1
            assert tok == int(np.argmax(row)), f"token {i}: engine {tok} != {int(np.argmax(row))}"
    return compared


def test_engine_greedy_is_transformers_argmax_for_every_chunk_size(hf):
    path, hf_model = hf
    prompts = prompts_for(3)
    by_chunk = {}
    for chunk in (1, 7, 32):
        outs = engine(path, chunk).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        by_chunk[chunk] = [out.token_ids for out in outs]
    assert by_chunk[1] == by_chunk[7] == by_chunk[32]
    compared = sum(clear_gap_matches(hf_model, p, t)
                   for p, t in zip(prompts, by_chunk[7], strict=True))
    assert compared >= 0.8 * NEW * len(prompts), f"only {compared} clear-gap tokens"


def test_batched_equals_solo_greedy_and_seeded_with_preemption(hf):
    path, _ = hf
    llm = engine(path, 7)
    prompts = prompts_for(4)
    params = [GREEDY if i % 2 else SamplingParams(temperature=0.9, top_p=0.95, seed=10 + i,
                                                  max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    batch = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for prompt, p, out in zip(prompts, params, batch, strict=True):
        solo = llm.generate(prompt_token_ids=[prompt], sampling_params=p)[0]
        assert out.token_ids == solo.token_ids


@pytest.mark.parametrize("arch", ["lfm2_bias", "zamba2_plain"])
def test_variant_logits_match_transformers(arch, tmp_path):
    """LFM2 with conv biases; Zamba2 with one shared block, no q/k/v adapters, no rotary."""
    hf_model = build(arch, tmp_path, seed=1)
    model, cfg = load_hf(tmp_path)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray(ids, jnp.int32)))
    assert np.abs(ours - ref).max() / np.abs(ref).max() <= 1e-4


def test_zamba2_stored_copies_of_tied_blocks_are_ignored(tmp_path):
    """A file that also stores layer 4's copy of shared block 0 (tied to layer 1's) loads the same."""
    from safetensors.numpy import load_file, save_file

    build("zamba2", tmp_path / "a", seed=1)
    tensors = load_file(tmp_path / "a" / "model.safetensors")
    first = "model.layers.1.shared_transformer."
    copies = {n.replace(first, "model.layers.4.shared_transformer."): v
              for n, v in tensors.items() if n.startswith(first)}
    assert copies
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    save_file(tensors | copies, tmp_path / "b" / "model.safetensors")
    a, b = (jax.tree.leaves(nnx.state(load_hf(tmp_path / x)[0])) for x in "ab")
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


ZAMBA2 = dict(architectures=["Zamba2ForCausalLM"], vocab_size=64, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=4, layers_block_type=["mamba", "hybrid"])
LFM2 = dict(architectures=["Lfm2ForCausalLM"], vocab_size=64, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, layer_types=["conv", "full_attention"])


@pytest.mark.parametrize("module,base,field,value,match", [
    (zamba2, ZAMBA2, "add_bias_linear", True, "add_bias_linear"),
    (zamba2, ZAMBA2, "use_long_context", True, "use_long_context"),
    (zamba2, ZAMBA2, "hidden_act", "relu", "hidden_act"),
    (zamba2, ZAMBA2, "layers_block_type", ["mamba", "moe"], "layers_block_type"),
    (zamba2, ZAMBA2, "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4}, "rope_type"),
    (lfm2, LFM2, "layer_types", ["conv", "sliding_attention"], "layer_types"),
    (lfm2, LFM2, "rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_type"),
])
def test_unsupported_values_are_refused_by_name(module, base, field, value, match):
    module.config_from_hf(base)  # the base loads
    with pytest.raises(ValueError, match=match):
        module.config_from_hf(base | {field: value})


# Parameters (tied embeddings once): LFM2-1.2B's published count; Zamba2-2.7B's nominal size.
PRESETS = {"lfm2-1.2b": (1_170_340_608, 0.0), "zamba2-2.7b": (2.7e9, 0.02)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_real_size_preset_size_and_one_step_with_tiny_overrides(name, capsys):
    from serving.entrypoints.cli import main

    assert main(["presets"]) == 0 and name in capsys.readouterr().out
    full = load_preset(name)
    abstract = nnx.eval_shape(lambda: CausalLM(full, rngs=nnx.Rngs(0)))
    n = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
    want, tol = PRESETS[name]
    assert abs(n / want - 1) <= tol, f"{name}: {n} parameters"
    layers = full.layers[:4] if name.startswith("lfm2") else full.layers[5:8]  # 8: a SHARED_BLOCK
    tiny = dataclasses.replace(full, vocab_size=128, hidden_size=64, layers=layers, **_shrink(full))
    assert {s.kind for s in tiny.layers} == {s.kind for s in full.layers}
    model = CausalLM(tiny, rngs=nnx.Rngs(0))
    logits = jax.jit(lambda t: model(t))(jnp.arange(24, dtype=jnp.int32)[None])
    assert logits.shape == (1, 24, 128) and bool(jnp.isfinite(logits).all())


def _shrink(cfg) -> dict:
    """Tiny sub-configs of the same structure as `cfg`'s (hidden 64)."""
    out = {"attention": dataclasses.replace(cfg.attention, num_heads=4, num_kv_heads=2,
                                            head_dim=32 if cfg.shared_block else 16)}
    if cfg.mamba2 is not None:
        out["mamba2"] = dataclasses.replace(cfg.mamba2, num_heads=4, head_dim=32, state_size=16,
                                            chunk_size=16)
    if cfg.mlp is not None:
        out["mlp"] = dataclasses.replace(cfg.mlp, intermediate_size=96)
    if cfg.shared_block is not None:
        out["shared_block"] = dataclasses.replace(cfg.shared_block, intermediate_size=96,
                                                  adapter_rank=8)
    return out
