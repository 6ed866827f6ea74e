"""The engine in bfloat16: parameters, pages and conv states in bf16, SSM/RG-LRU states in f32.

bf16 rounds differently along the cached path and the full forward, so tokens are
compared only while the full forward's top-1/top-2 gap is clear (> 0.05); the first
low-gap step ends the comparison.
"""

from __future__ import annotations

import jax.numpy as jnp

from hybrid_jax.generate import greedy_steps
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams


def test_bf16_engine_follows_the_bf16_full_forward():
    lm = load_model("native-tiny", dtype="bfloat16")
    assert lm.model.embed.embedding[...].dtype == jnp.bfloat16
    engine = LLMEngine(lm, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32,
                                        max_prefill_chunk=16, max_model_len=128, page_size=8,
                                        dtype="bfloat16"), show_progress=False)
    assert engine.runner.caches.kv[0].k.dtype == jnp.bfloat16
    assert engine.runner.caches.mamba.ssm.dtype == jnp.float32
    prompts = [list(range(3, 73)), [5, 6, 7]]
    outs = LLM.from_engine(engine).generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    compared = 0
    for prompt, out in zip(prompts, outs, strict=True):
        for got, (want, gap) in zip(out.token_ids, greedy_steps(lm.model, prompt, 12), strict=True):
            if gap < 0.05:
                break
            assert got == want
            compared += 1
    assert compared >= 6
