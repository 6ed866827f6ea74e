"""Greedy output through the engine equals the full-sequence forward, for every architecture.

For Mamba2, Mistral-SWA, RecurrentGemma, Falcon-H1 (tiny random transformers models
loaded from disk) and the native hybrid preset: prompts longer than every window,
prefill chunk sizes 1, 7 and larger than the prompt, a ragged batch of prompts served
together. The reference recomputes the whole sequence for every token
(hybrid_jax.generate), sharing no code with the paged, slot-indexed serving path.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from hybrid_jax import (  # noqa: E402
    AttentionConfig,
    CausalLM,
    LayerSpec,
    Mamba2Config,
    MLPConfig,
    ModelConfig,
)
from hybrid_jax.generate import greedy_generate  # noqa: E402
from hybrid_jax.loading import LoadedModel, load_model  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from tests.model.hf_models import build  # noqa: E402

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU: outside the quick subset (-m "not slow")

NEW = 10
PROMPT_LENS = (21, 3, 30)  # every test window is 16 (the native preset's is 64)
ARCHS = ("mamba2", "mistral", "recurrent_gemma", "falcon_h1")


def native_hybrid() -> LoadedModel:
    """The native family (parallel hybrid + SWA-only + Mamba2-only layers), window 16."""
    cfg = ModelConfig(
        architecture="native", vocab_size=128, hidden_size=64,
        layers=(LayerSpec("hybrid", 16), LayerSpec("attention", 16), LayerSpec("mamba2"),
                LayerSpec("hybrid", 16)),
        attention=AttentionConfig(4, 2, 16), mamba2=Mamba2Config(4, 16, 16, chunk_size=16),
        mlp=MLPConfig(128), max_position_embeddings=64)
    return LoadedModel(CausalLM(cfg, rngs=nnx.Rngs(0)), cfg, None, "test")


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out: dict[str, str | LoadedModel] = {"native": native_hybrid()}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        build(arch, d, seed=0)
        out[arch] = str(d)
    return out


def loaded(source: str | LoadedModel) -> LoadedModel:
    return source if isinstance(source, LoadedModel) else load_model(source)


def llm_for(source: str | LoadedModel, chunk: int) -> LLM:
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=chunk,
                       max_model_len=64, page_size=8)
    return LLM.from_engine(LLMEngine(loaded(source), cfg, show_progress=False))


# Chunks of 1 and 7 tokens (CI time: 32, one chunk per prompt, is what most other engine
# tests run).
@pytest.mark.parametrize("chunk", [1, 7])
@pytest.mark.parametrize("arch", (*ARCHS, "native"))
def test_engine_greedy_equals_full_forward(hf_dirs, arch, chunk):
    lm = loaded(hf_dirs[arch])
    rng = np.random.default_rng(chunk)
    prompts = [rng.integers(0, lm.config.vocab_size, n).tolist() for n in PROMPT_LENS]
    llm = llm_for(hf_dirs[arch], chunk)
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=NEW,
                                                       ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.token_ids == greedy_generate(lm.model, prompt, NEW), arch
        assert out.finish_reason == "length"


def test_native_preset_text_prompts_equal_full_forward():
    llm = LLM("native-tiny", max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7,
              max_model_len=128, show_progress=False)
    lm = load_model("native-tiny")
    prompts = ["x" * 70, "hybrid", "the window is 64 tokens long, this prompt is longer than it is"]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = lm.tokenizer.encode(prompt, add_bos=True)
        assert out.prompt_token_ids == ids
        assert out.token_ids == greedy_generate(lm.model, ids, NEW)
        assert out.text == lm.tokenizer.decode(out.token_ids)
