"""The engine's greedy tokens equal transformers' argmax for Gemma 3, Bamba,
Granite-4.0-H and Nemotron-H (tiny random models built with transformers, loaded from disk).

Prompts of 3, 16 and 30 tokens (below, at and beyond every test window and SSD chunk,
both 16) are served together in a ragged batch with prefill chunks of 7 tokens, so
prompts cross chunk, window and page boundaries over several steps. transformers then
scores prompt + generated tokens in one uncached forward (teacher forcing): wherever its
top-1/top-2 logit gap exceeds 1e-3, the engine's token must be its argmax. Each request
served alone gives the same tokens as in the batch (greedy and seeded sampling). Gemma 3
runs its window-16 group and its global group side by side in one engine; with whole
prompts in one chunk and too few pages for the batch (preemption by recompute) it gives
the same tokens again. (Gemma 2 is Gemma 3's
layer without q/k norms, plus attention soft-capping, which the paged-kernel tests cover;
it is checked against transformers in tests/model/test_hf_parity.py.)
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.loading import load_model  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from tests.model.hf_models import build  # noqa: E402

NEW = 10
GAP = 1e-3
PROMPT_LENS = (3, 16, 30)
ARCHS = ("gemma3", "bamba", "granite_hybrid", "nemotron_h", "granite_moe", "lfm2_moe",
         "nemotron_h_moe")
# Attention groups the engine must plan: (window, pages a sequence may hold at once).
GROUPS = {"gemma3": ((16, 4), (None, 8)), "bamba": ((None, 8),), "granite_hybrid": ((None, 8),),
          "nemotron_h": ((None, 8),), "granite_moe": ((None, 8),), "lfm2_moe": ((None, 8),),
          "nemotron_h_moe": ((None, 8),)}


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def engine(path: str, chunk: int, **kw) -> LLMEngine:
    # One mixed bucket (32 tokens) and the decode bucket: two compilations per engine.
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=chunk,
                       page_size=8, token_buckets=(32,), **{"max_model_len": 64} | kw)
    return LLMEngine(load_model(path), cfg, show_progress=False)


def engine_tokens(eng: LLMEngine, prompts: list[list[int]],
                  params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    outs = LLM.from_engine(eng).generate(prompt_token_ids=prompts, sampling_params=params)
    return [out.token_ids for out in outs]


def seeded(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=NEW,
                           ignore_eos=True) for i in range(n)]


def check_against_transformers(hf_model, prompt: list[int], tokens: list[int]) -> int:
    """Positions compared (gap > GAP); asserts the engine's token is transformers' argmax there."""
    seq = prompt + tokens
    with torch.no_grad():
        logits = hf_model(torch.tensor([seq])).logits[0, len(prompt) - 1:-1].numpy()
    compared = 0
    for i, (row, tok) in enumerate(zip(logits, tokens, strict=True)):
        top2 = np.sort(row)[-2:]
        if top2[1] - top2[0] > GAP:
            compared += 1
            assert tok == int(np.argmax(row)), (
                f"token {i}: engine {tok} != transformers {int(np.argmax(row))} "
                f"(gap {top2[1] - top2[0]:.2e})")
    return compared


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_transformers_argmax(arch, tmp_path):
    hf_model = build(arch, tmp_path, seed=0)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS]
    eng = engine(str(tmp_path), chunk=7)
    groups = tuple((g.window, g.width) for g in eng.scheduler.groups)
    assert groups == GROUPS[arch]
    outs = engine_tokens(eng, prompts)
    compared = sum(check_against_transformers(hf_model, p, t)
                   for p, t in zip(prompts, outs, strict=True))
    assert compared >= 0.8 * NEW * len(prompts), f"{arch}: only {compared} clear-gap tokens"
    # A request's tokens do not depend on the batch it is served in.
    assert [engine_tokens(eng, [p])[0] for p in prompts] == outs
    sampled = engine_tokens(eng, prompts, seeded(len(prompts)))
    assert [engine_tokens(eng, [p], [sp])[0] for p, sp in zip(prompts, seeded(3), strict=True)] \
        == sampled
    if arch == "gemma3":  # whole prompts in one chunk, too few pages: preemption by recompute
        tight = engine(str(tmp_path), chunk=32, max_model_len=48, num_pages=8)
        assert engine_tokens(tight, prompts) == outs
        assert tight.stats()["num_preemptions"] > 0
