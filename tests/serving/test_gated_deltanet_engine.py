"""Qwen3-Next (Gated DeltaNet + gated attention + MoE) through the engine.

One tiny random transformers Qwen3NextForCausalLM (tests/model/hf_models.py), loaded from
disk, served by ONE engine (it compiles its buckets once: CI time) with 7-token prefill
chunks, prefix caching (state checkpoints every 16 tokens), too few pages for the batch
(preemption by recompute) and ngram speculation on. The reference is transformers itself,
teacher-forced over prompt + output: wherever its top-1/top-2 gap exceeds 1e-3 the
engine's token is its argmax, and the engine's logprob of its token is transformers'
log-softmax within 1e-4.

1. prompts of 3, 16 and 30 tokens in one ragged batch (cold cache); each alone again gives
   the same tokens and logprobs (their prefixes now hit the cache: a hit == a miss);
2. a warm request of 45 tokens, then four sharing 33, 44, 37 and 20 of its tokens (hits
   on and off checkpoints), with preemptions;
3. the same requests without logprobs (speculated) while an oracle drafts their
   continuation, corrupted at random: verification keeps the Gated DeltaNet states after
   each drafted position and the accepted one is chosen; tokens equal step 2's, with
   some drafts accepted and some rejected.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.config import LayerKind  # noqa: E402
from hybrid_jax.loading import load_model  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from tests.model.hf_models import build  # noqa: E402
from tests.serving.test_engine_parity_hybrids import check_against_transformers  # noqa: E402
from tests.serving.test_prefix_cache import assert_same  # noqa: E402
from tests.serving.test_speculative import Oracle, assert_exercised, staggered  # noqa: E402

NEW = 8
CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                   page_size=8, seq_buckets=(4,), token_buckets=(32,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)
SHARED = (33, 44, 37, 20)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_next")
    hf_model = build("qwen3_next", d, seed=0)
    lm = load_model(str(d))
    kinds = [s.kind for s in lm.config.layers]
    assert LayerKind.GATED_DELTANET in kinds and LayerKind.ATTENTION in kinds
    assert any(s.moe for s in lm.config.layers)
    return hf_model, lm


def generate(eng: LLMEngine, prompts: list[list[int]]):
    return LLM.from_engine(eng).generate(prompt_token_ids=prompts, sampling_params=GREEDY)


def check(hf_model, prompts: list[list[int]], outs) -> int:
    """Tokens are transformers' argmax where its gap is clear; logprobs its log-softmax."""
    compared = 0
    for p, o in zip(prompts, outs, strict=True):
        compared += check_against_transformers(hf_model, p, o.token_ids)
        with torch.no_grad():
            logits = hf_model(torch.tensor([p + o.token_ids])).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits.double(), -1).numpy()
        got = [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)]
        want = [ref[i, t] for i, t in enumerate(o.token_ids)]
        np.testing.assert_allclose(got, want, atol=1e-4)
    return compared


def test_engine_equals_transformers_and_invariants(qwen):
    hf_model, lm = qwen
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 16, 30)]
    base = rng.integers(0, 128, 45).tolist()
    shared = [base[:n] + rng.integers(0, 128, 6).tolist() for n in SHARED]
    cfg = dataclasses.replace(CFG, enable_prefix_caching=True, prefix_state_stride=16, num_pages=12,
                              speculative_method="ngram", num_speculative_tokens=3)
    eng = LLMEngine(lm, cfg, show_progress=False)

    # 1. Cold batch; then each alone, resuming from the cache (rows with logprobs: no speculation).
    outs = generate(eng, prompts)
    compared = check(hf_model, prompts, outs)
    assert compared >= 0.8 * NEW * len(prompts), f"only {compared} clear-gap tokens"
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert_same([generate(eng, [p])[0] for p in prompts], outs)
    assert eng.stats()["prefix_cache_hit_tokens"] > hits

    # 2. Shared prefixes of a warm request, under preemption.
    want = generate(eng, [base]) + generate(eng, shared)
    check(hf_model, [base, *shared], want)
    s = eng.stats()
    assert s["prefix_state_checkpoints_cached"] > 0 and s["num_preemptions"] > 0

    # 3. Speculation (oracle drafts, some wrong) over cached prefixes.
    refs = [o.token_ids for o in want]
    eng.drafter = Oracle({tuple(p): r for p, r in zip([base, *shared], refs, strict=True)}, 128)
    assert staggered(eng, [base, *shared], dataclasses.replace(GREEDY, logprobs=None)) == refs
    assert_exercised(eng)
