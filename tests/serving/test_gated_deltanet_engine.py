"""Qwen3-Next (Gated DeltaNet + gated attention + MoE) through the engine, with its MTP head.

One tiny random transformers Qwen3NextForCausalLM saved WITH an MTP head in the published
layout (`mtp.*`, tests/serving/qwen_mtp_helpers.py; the target damped so that the head's
drafts agree often, not always), loaded from disk, served by ONE engine (it compiles its
buckets once: CI time) with 7-token prefill chunks, prefix caching (state checkpoints
every 16 tokens), too few pages for the batch (preemption by recompute) and
speculative_method="mtp" with k = 2. Rows that ask for logprobs are not speculated, so
the same engine gives the plain greedy reference. The reference is transformers itself,
teacher-forced over prompt + output: wherever its top-1/top-2 gap exceeds 1e-3 the
engine's token is its argmax, and the engine's logprob of its token is transformers'
log-softmax within 1e-4.

1. prompts of 3, 16 and 30 tokens in one ragged batch (cold cache); each alone again gives
   the same tokens and logprobs (their prefixes now hit the cache: a hit == a miss);
2. a warm request of 45 tokens, then four sharing 33, 44, 37 and 20 of its tokens (hits
   on and off checkpoints), with preemptions;
3. the four sharing requests again in one batch, speculated by the MTP head (prefix hits,
   preemptions): tokens equal step 2's, with drafts accepted and rejected, so
   verification keeps the Gated DeltaNet states after each drafted position and the
   accepted one is chosen; again with the head's first draft only (one draft per step);
4. all five with an oracle drafting their continuation, corrupted at random, prefills
   interleaved with verification (full acceptance of both drafts too, which the head
   rarely reaches).
(An engine with num_speculative_tokens=1 passed the same checks; it is left out of the
suite for CI time: ~40 s more compilation for executables of other shapes.) The head's
drafts are checked against a torch reference of the head built from transformers' own
decoder layer: the engine's drafts are its argmax wherever its gap is
clear (the head's logits within 1e-4 of it: tests/model/test_fp8_checkpoints.py, on the
Qwen3.5-MoE layout).
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
from serving.spec_decode.mtp import MTPDrafter  # noqa: E402
from tests.serving.qwen_mtp_helpers import build_with_mtp, text_model  # noqa: E402
from tests.serving.test_engine_parity_hybrids import GAP, check_against_transformers  # noqa: E402
from tests.serving.test_prefix_cache import assert_same  # noqa: E402
from tests.serving.test_speculative import Oracle, assert_exercised, staggered  # noqa: E402

NEW = 8
DAMP = 0.1
CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                   page_size=8, seq_buckets=(4,), token_buckets=(32,), enable_prefix_caching=True,
                   prefix_state_stride=16, num_pages=12, speculative_method="mtp",
                   num_speculative_tokens=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=5)
SPEC = dataclasses.replace(GREEDY, logprobs=None)
SHARED = (33, 44, 37, 20)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_next_mtp")
    hf_model, head = build_with_mtp("qwen3_next", d, seed=0, damp=DAMP)
    lm = load_model(str(d))
    kinds = [s.kind for s in lm.config.layers]
    assert LayerKind.GATED_DELTANET in kinds and LayerKind.ATTENTION in kinds
    assert any(s.moe for s in lm.config.layers)
    assert lm.config.mtp_num_hidden_layers == 1 and lm.model.mtp is not None
    return hf_model, head, lm


@pytest.fixture(scope="module")
def requests():
    rng = np.random.default_rng(3)
    base = rng.integers(0, 128, 45).tolist()
    return base, [base[:n] + rng.integers(0, 128, 6).tolist() for n in SHARED]


def generate(eng: LLMEngine, prompts: list[list[int]], params=GREEDY):
    return LLM.from_engine(eng).generate(prompt_token_ids=prompts, sampling_params=params)


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


def speculated(eng: LLMEngine, prompts: list[list[int]], want: list[list[int]]) -> dict:
    """Serve `prompts` speculated, in one batch; tokens must be `want`; returns the
    counters' change."""
    before = eng.stats()
    assert [o.token_ids for o in generate(eng, prompts, SPEC)] == want
    after = eng.stats()
    return {k: after[k] - before[k] for k in ("spec_verify_steps", "spec_proposed_tokens",
                                              "spec_accepted_tokens", "num_preemptions",
                                              "prefix_cache_hit_tokens")}


class DraftSpy(list):
    """Records (tokens, drafts) of the engine's proposals of two drafts."""

    def __init__(self, eng: LLMEngine):
        super().__init__()
        self.propose = eng.drafter.propose_batch

        def spy(work):
            out = self.propose(work)
            self.extend((list(t), d) for (_, t, _), d in zip(work, out, strict=True) if len(d) == 2)
            return out

        eng.drafter.propose_batch = spy


def check_drafts(hf_model, head, seen: list) -> None:
    """Each draft is the torch reference head's argmax where its top-1/top-2 gap is clear:
    draft 1 from the target's hidden state at the last token, draft 2 from the head's own
    output there and draft 1, one position on (vLLM's MTP proposer)."""
    assert seen
    tm, compared = text_model(hf_model), 0
    for toks, drafts in seen:
        with torch.no_grad():
            t = torch.tensor([toks])
            h = tm(input_ids=t).last_hidden_state[:, :-1]
            g = head(tm, t[:, 1:], h)
            g2 = head(tm, torch.tensor([toks[1:] + [drafts[0]]]), torch.cat([h, g[:, -1:]], 1))
            rows = hf_model.lm_head(torch.stack([g[0, -1], g2[0, -1]])).numpy()
        for row, tok in zip(rows, drafts, strict=True):
            top2 = np.sort(row)[-2:]
            if top2[1] - top2[0] > GAP:
                compared += 1
                assert tok == int(np.argmax(row)), (toks, drafts)
    assert compared >= len(seen)


def test_engine_equals_transformers_and_invariants(qwen, requests):
    hf_model, _, lm = qwen
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 16, 30)]
    base, shared = requests
    eng = LLMEngine(lm, CFG, show_progress=False)
    assert isinstance(eng.drafter, MTPDrafter)

    # 1. Cold batch; then each alone, resuming from the cache (rows with logprobs: no speculation).
    outs = generate(eng, prompts)
    compared = check(hf_model, prompts, outs)
    assert compared >= 0.8 * NEW * len(prompts), f"only {compared} clear-gap tokens"
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert_same([generate(eng, [p])[0] for p in prompts], outs)
    assert eng.stats()["prefix_cache_hit_tokens"] > hits
    assert eng.stats()["spec_verify_steps"] == 0

    # 2. Shared prefixes of a warm request, under preemption.
    want = generate(eng, [base]) + generate(eng, shared)
    check(hf_model, [base, *shared], want)
    s = eng.stats()
    assert s["prefix_state_checkpoints_cached"] > 0 and s["num_preemptions"] > 0
    refs = [o.token_ids for o in want]

    # 3. MTP speculation over cached prefixes, under preemption: drafts accepted and rejected;
    # the drafts are the torch reference head's.
    seen = DraftSpy(eng)
    d = speculated(eng, shared, refs[1:])
    eng.drafter.propose_batch = seen.propose
    check_drafts(hf_model, qwen[1], seen)
    assert d["spec_verify_steps"] > 0 and 0 < d["spec_accepted_tokens"] < d["spec_proposed_tokens"], d
    assert d["num_preemptions"] > 0 and d["prefix_cache_hit_tokens"] > 0, d
    # One draft per step (the head's first): a single draft accepted or rejected.
    eng.drafter.propose_batch = lambda work: [x[:1] for x in seen.propose(work)]
    d = speculated(eng, shared, refs[1:])
    eng.drafter.propose_batch = seen.propose
    assert 0 < d["spec_accepted_tokens"] < d["spec_proposed_tokens"] <= d["spec_verify_steps"] * 4, d

    # 4. Oracle drafts (some wrong), both drafts accepted at times.
    mtp, eng.drafter = eng.drafter, Oracle({tuple(p): r for p, r in zip([base, *shared], refs, strict=True)},
                                           128)
    try:
        assert staggered(eng, [base, *shared], SPEC) == refs
        assert_exercised(eng)
    finally:
        eng.drafter = mtp
    # The head drafts again after another drafter's steps (its K/V are rewritten by them).
    assert speculated(eng, [shared[0]], refs[1:2])["spec_verify_steps"] > 0
