"""Parity with transformers on tiny random models: logits and greedy continuations.

Each test builds a model with transformers (tests/model/hf_models.py), saves it with
save_pretrained, loads it with hybrid_jax, and compares in f32:
- logits over 80 tokens (longer than every window and several SSD chunks):
  max |ours - hf| / max |hf| <= 1e-4, except at positions where the model is
  ill-conditioned, measured against transformers' float64 forward
  (`check_ill_conditioned`: f32 rounding amplified, not a different computation);
- 32 greedy tokens from our full forward (recomputed over the whole sequence each
  step) against transformers' own cached `generate`: tokens must agree wherever our
  top-1/top-2 logit gap exceeds 1e-3; the first low-gap disagreement ends the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.checkpoints import load_hf  # noqa: E402
from hybrid_jax.generate import greedy_steps  # noqa: E402
from tests.model.hf_models import BUILDERS, TOL, build, check_ill_conditioned  # noqa: E402

pytestmark = pytest.mark.slow  # minutes on a 2-core CPU: outside the quick subset (-m "not slow")

SEQ = 80
PROMPT = 16
NEW = 32
GAP = 1e-3


def compare_greedy(ours: list[int], gaps: list[float], theirs: list[int]) -> int:
    """Number of tokens compared before the first (allowed, low-gap) divergence."""
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if a != b:
            assert gaps[i] < GAP, f"token {i}: ours {a} != transformers {b} with gap {gaps[i]:.2e}"
            return i
    return len(ours)


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_logits_and_greedy_match_transformers(arch, tmp_path):
    hf_model = build(arch, tmp_path, seed=0)
    model, cfg = load_hf(tmp_path, dtype=jnp.float32)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, SEQ))
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(jax.jit(lambda x: model(x))(jnp.asarray(ids, jnp.int32)))  # eager: 4x slower
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    if err > TOL:
        check_ill_conditioned(arch, hf_model, ids, ours, ref)

    prompt = ids[0, :PROMPT]
    with torch.no_grad():
        gen = hf_model.generate(torch.tensor(prompt[None]), max_new_tokens=NEW, do_sample=False,
                                min_new_tokens=NEW, pad_token_id=0)
    theirs = gen[0, PROMPT:].tolist()
    tokens, gaps = map(list, zip(*greedy_steps(model, prompt.tolist(), NEW), strict=True))
    matched = compare_greedy(tokens, gaps, theirs)
    print(f"{arch}: max rel logit err {err:.2e}, greedy matched {matched}/{NEW}")
    assert matched >= NEW // 2, f"{arch}: only {matched} greedy tokens compared"
