"""MTP speculative decoding (serving/spec_decode/mtp.py): greedy output equals plain
greedy decoding, a head that agrees with its target gets its drafts accepted, the
acceptance keeps the target distribution with MTP drafts, and the head's loader is strict.

References are independent of the code under test: `greedy_generate` (the full-sequence
forward recomputed per token), the head's full-sequence forward (`MTPHead.__call__`) for
the drafts, float64 numpy for the acceptance distribution.
One engine (native hybrid: attention, Mamba2 and parallel hybrid layers; prefix caching
on, so speculation, MTP K/V and recurrent state checkpoints work together).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.checkpoints import mistral
from hybrid_jax.checkpoints.hf import CheckpointError
from hybrid_jax.checkpoints.mtp import load_mtp, mtp_weight_map
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.generate import greedy_generate
from hybrid_jax.model import CausalLM
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling import SamplingArrays
from serving.sample.sampling_params import SamplingParams
from serving.spec_decode.speculative import accept
from tests.serving.mtp_helpers import agreeing_head, native_with_mtp
from tests.serving.test_engine_parity import native_hybrid

NEW = 14
DAMP = 0.1  # the target's sub-blocks scaled: the head's drafts agree often, not always
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def lm():
    out = native_with_mtp()
    agreeing_head(out, DAMP)
    return out


@pytest.fixture(scope="module")
def engine(lm):
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
                       page_size=8, seq_buckets=(4,), token_buckets=(32,), speculative_method="mtp",
                       num_speculative_tokens=2, enable_prefix_caching=True, prefix_state_stride=16)
    return LLMEngine(lm, cfg)  # with the progress line, as `hybrid-jax serve` shows it (every key kind)


def run(eng, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in LLM.from_engine(eng).generate(prompt_token_ids=prompts,
                                                               sampling_params=params)]


def test_mtp_greedy_equals_plain_with_prefix_caching(lm, engine):
    """Batched and solo, with and without prefix-cache hits: the reference tokens; the
    head's drafts are accepted more than half the time, and some are rejected."""
    rng = np.random.default_rng(3)
    base = rng.integers(0, 128, 40).tolist()
    prompts = [base, rng.integers(0, 128, 5).tolist(), base[:33] + [3, 4, 5], base[:20] + [9]]
    refs = [greedy_generate(lm.model, p, NEW) for p in prompts]
    assert run(engine, prompts[:2]) == refs[:2]
    s = engine.stats()
    assert s["spec_verify_steps"] > 0
    assert s["spec_acceptance_rate"] > 0.5, s
    assert s["spec_accepted_tokens"] < s["spec_proposed_tokens"]  # rejections happened too
    hits = s["prefix_cache_hit_tokens"]
    assert run(engine, prompts[2:]) == refs[2:]  # both resume from the cache (base's pages)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits
    assert [run(engine, [p])[0] for p in prompts[2:]] == refs[2:]  # solo
    assert engine.stats()["spec_acceptance_rate"] > 0.5
    # Seeded sampling through verification is reproducible.
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    steps = engine.stats()["spec_verify_steps"]
    assert run(engine, [prompts[1]], seeded) == run(engine, [prompts[1]], seeded)
    assert engine.stats()["spec_verify_steps"] > steps


def test_engine_drafts_are_the_heads_full_sequence_drafts(lm, engine):
    """The drafts the engine proposes equal the head's full-sequence forward (draft 1 from
    the target's hidden state, draft 2 from the head's own output)."""
    seen = []
    propose = engine.drafter.propose_batch

    def spy(work):
        out = propose(work)
        seen.extend((list(toks), d) for (_, toks, _), d in zip(work, out, strict=True) if d)
        return out

    engine.drafter.propose_batch = spy
    try:
        prompt = np.random.default_rng(4).integers(0, 128, 11).tolist()
        run(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    finally:
        engine.drafter.propose_batch = propose
    assert seen
    m = lm.model
    for toks, drafts in seen[::3]:  # proposals spread over the run (each check compiles)
        x = jnp.asarray([toks])
        hidden = m.final_norm(m.hidden(x))[:, :-1]
        pos = jnp.arange(len(toks) - 1)[None]
        g = m.mtp(m.embed_tokens(x)[:, 1:], hidden, pos)
        want = [int(jnp.argmax(m.head(g[0, -1])))]
        # draft 2: the head's output at the last position and draft 1, at the next position
        g2 = m.mtp(m.embed_tokens(jnp.asarray([toks[1:] + want])), jnp.concatenate([hidden, g[:, -1:]], 1),
                   jnp.arange(len(toks))[None])
        want.append(int(jnp.argmax(m.head(g2[0, -1]))))
        assert drafts == want[:len(drafts)], (toks, drafts, want)


def test_acceptance_keeps_the_target_distribution_with_mtp_drafts(lm):
    """Chi-square: with the head's drafts (point masses, likely tokens), the tokens that
    `accept` emits follow the target's filtered distribution (top-k 5, temperature 0.9)."""
    from scipy.stats import chisquare

    m, n, temp, top_k = lm.model, 15000, 0.9, 5
    prompt = np.random.default_rng(5).integers(0, 128, 12).tolist()
    x = jnp.asarray([prompt])
    hidden = m.final_norm(m.hidden(x))
    g = m.mtp(m.embed_tokens(x)[:, 1:], hidden[:, :-1], jnp.arange(len(prompt) - 1)[None])
    d1 = int(jnp.argmax(m.head(g[0, -1])))
    logits = np.asarray(m(jnp.asarray([prompt + [d1]]))[0, -2:], np.float64)  # positions verifying d1
    v = logits.shape[-1]
    p = np.exp(logits / temp - np.max(logits / temp, axis=1, keepdims=True))
    p *= logits >= np.sort(logits, axis=1)[:, -top_k][:, None]
    p /= p.sum(axis=1, keepdims=True)
    rows = SamplingArrays.from_rows([{"temperature": temp, "top_k": top_k, "seed": 77 + i, "step": 2}
                                     for i in range(n)])
    tokens = jnp.tile(jnp.array([[prompt[-1], d1]], jnp.int32), (n, 1))
    out, acc = jax.jit(accept)(jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1, 1)), tokens,
                               jnp.ones((n,), jnp.int32), rows)
    first = np.bincount(np.asarray(out)[:, 0], minlength=v)
    keep = p[0] > 0
    assert first[~keep].sum() == 0
    assert chisquare(first[keep], p[0][keep] * n).pvalue > 1e-3
    assert abs((np.asarray(acc) >= 1).mean() - p[0, d1]) < 0.02


def test_a_model_without_an_mtp_head_is_refused_by_name():
    with pytest.raises(ValueError, match="speculative_method='mtp'.*no multi-token-prediction head"):
        LLMEngine(native_hybrid(), EngineConfig(max_num_seqs=2, max_model_len=64, speculative_method="mtp",
                                                num_speculative_tokens=2), show_progress=False)
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="mtp", speculative_model="native-tiny")


def test_mtp_loader_is_strict_and_round_trips():
    """The mtp.* names come from the architecture's own map (Mistral here): a head's
    tensors written in torch layout load back exactly; missing, unexpected and mis-shaped
    tensors are reported together."""
    cfg = ModelConfig(architecture="mistral", vocab_size=64, hidden_size=32,
                      layers=(LayerSpec("attention"),) * 2, attention=AttentionConfig(4, 2, 8),
                      mlp=MLPConfig(64), mtp_num_hidden_layers=1)
    src, dst = CausalLM(cfg, rngs=nnx.Rngs(1)), CausalLM(cfg, rngs=nnx.Rngs(2))
    trunk = mistral.weight_map(cfg)
    wmap = mtp_weight_map(cfg, trunk)
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_proj.weight",
            "mtp.layers.0.mlp.down_proj.weight", "mtp.layers.0.input_layernorm.weight"} <= set(wmap)
    flat = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(src))}
    tensors = {name: np.asarray(flat[t.path].T if t.transform == "linear" else flat[t.path])
               for name, t in wmap.items()}
    load_mtp(dst, tensors, trunk)
    for a, b in zip(jax.tree.leaves(nnx.state(src.mtp)), jax.tree.leaves(nnx.state(dst.mtp)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bad = dict(tensors)
    del bad["mtp.norm.weight"]
    bad["mtp.layers.0.extra.weight"] = np.zeros(3)
    bad["mtp.fc.weight"] = np.zeros((32, 32))
    with pytest.raises(CheckpointError) as err:
        load_mtp(dst, bad, trunk, "ckpt")
    assert err.value.missing == ["mtp.norm.weight"]
    assert err.value.unexpected == ["mtp.layers.0.extra.weight"]
    assert len(err.value.misshaped) == 1 and "mtp.fc.weight" in err.value.misshaped[0]
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        ModelConfig(architecture="mamba2", vocab_size=64, hidden_size=32, layers=(LayerSpec("mamba2"),),
                    mamba2=Mamba2Config(4, 16, 16), mtp_num_hidden_layers=1)


def test_cli_takes_the_mtp_method():
    from serving.entrypoints.cli_args import build_parser
    from serving.entrypoints.cli_commands import spec_kwargs

    args = build_parser().parse_args(["generate", "hi", "--speculative-method", "mtp",
                                      "--num-speculative-tokens", "2"])
    cfg = EngineConfig(**spec_kwargs(args))
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.spec_q) == ("mtp", 2, 3)
