"""Jamba (Mamba1 + attention + MoE) through the engine, on ONE compiled engine (CI time):
chunked prefill (7-token chunks), speculative decoding (oracle drafts, k = 2), prefix
caching with Mamba1 state checkpoints, and a page pool too small for the batch
(preemption by recompute).

References are independent of the serving path: greedy tokens of our full-sequence
forward (the prompts right-padded into one batch so it compiles once; no pages, slots,
chunks or verification: "speculation off, no cache, one chunk") and transformers'
teacher-forced logits (the engine's token is its argmax wherever the top-1/top-2 gap
exceeds 1e-3). Checked: every request's greedy tokens equal the reference whether
served alone or batched, on a prefix-cache miss or hit, with drafts accepted and
rejected, and across preemptions.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hybrid_jax.loading import load_model  # noqa: E402
from tests.model.hf_models import build  # noqa: E402
from tests.serving.test_engine_parity_hybrids import check_against_transformers  # noqa: E402
from tests.serving.test_speculative import (  # noqa: E402
    Oracle,
    assert_exercised,
    prompts_for,
    run,
    spec_engine,
)

pytestmark = pytest.mark.slow  # about a minute on a 2-core CPU: outside the quick subset

NEW = 12


def batched_greedy(model, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Greedy continuations by the full forward recomputed each step (causal: right padding
    is never seen), all prompts in one [b, longest + new] batch."""
    ids = np.zeros((len(prompts), max(map(len, prompts)) + new), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    fwd = jax.jit(lambda x, at: jnp.take_along_axis(model(x), at[:, None, None], axis=1)[:, 0])
    lens = np.array([len(p) for p in prompts])
    for step in range(new):
        tok = np.argmax(np.asarray(fwd(jnp.asarray(ids), jnp.asarray(lens + step - 1))), axis=-1)
        ids[np.arange(len(prompts)), lens + step] = tok
    return [ids[i, n:n + new].tolist() for i, n in enumerate(lens)]


def test_jamba_engine_chunked_speculative_prefix_cached_preempted(tmp_path):
    hf_model = build("jamba", tmp_path, seed=0)
    lm = load_model(str(tmp_path))
    vocab = lm.config.vocab_size
    base = prompts_for(vocab, seed=7, lens=(40,))[0]
    prompts = [base, base[:33] + [3, 4, 5], base[:20] + [9], prompts_for(vocab, seed=8, lens=(5,))[0]]
    refs = batched_greedy(lm.model, prompts, NEW)
    compared = sum(check_against_transformers(hf_model, p, r) for p, r in zip(prompts, refs, strict=True))
    assert compared >= 0.8 * NEW * len(prompts), f"only {compared} clear-gap tokens"
    # 10 pages of 8 tokens: two long sequences (7 pages each at the end) cannot run together.
    eng = spec_engine(lm, 2, enable_prefix_caching=True, prefix_state_stride=16, num_pages=11)
    eng.drafter = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, vocab, seed=1)
    assert run(eng, prompts[:1]) == refs[:1]  # a miss: fills the cache
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert run(eng, prompts[1:]) == refs[1:]  # batched; two resume from the cache
    assert eng.stats()["prefix_cache_hit_tokens"] > hits
    assert [run(eng, [p])[0] for p in prompts[1:]] == refs[1:]  # solo
    assert run(eng, prompts) == refs  # all four at once: the pool is too small
    assert eng.stats()["num_preemptions"] > 0
    assert_exercised(eng)
