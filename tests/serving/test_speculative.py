"""Speculative decoding is token-identical to plain greedy decoding, for every architecture.

References are independent of the code under test: `hybrid_jax.generate.greedy_generate`
(the full-sequence forward recomputed for every token: no pages, slots or verification)
for greedy tokens, float64 numpy for the acceptance distribution, and the plain ragged
forward over the accepted tokens only for the recurrent state.

An oracle drafter (`Oracle`) proposes the reference continuation with random
corruptions and random lengths (0..k), so steps with nothing proposed, everything
rejected, partial and full acceptance all occur; tests assert that they did.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from hybrid_jax.cache import RaggedBatch, init_caches, states_of  # noqa: E402
from hybrid_jax.generate import greedy_generate  # noqa: E402
from hybrid_jax.ragged import choose, forward_ragged, forward_verify  # noqa: E402
from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.llm import LLM  # noqa: E402
from serving.sample.sampling import SamplingArrays  # noqa: E402
from serving.sample.sampling_params import SamplingParams  # noqa: E402
from serving.spec_decode.speculative import NgramDrafter, accept  # noqa: E402
from tests.model.hf_models import build  # noqa: E402
from tests.serving.test_engine_parity import loaded, native_hybrid  # noqa: E402

NEW = 12
BASE = dict(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=7, max_model_len=64,
            page_size=8, seq_buckets=(4,), token_buckets=(32,))
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
# k spread over the architectures (each engine compiles once: CPU time).
# The native hybrid (k=3; its SWA-only layer covers attention-only K/V rewind, as in
# Mistral-SWA) is covered by the prefix-caching / preemption test. CI time: one engine each;
# Falcon-H1 (Mamba2 + attention in parallel) and pure Mamba2 left CI for time: their
# rollback is Mamba2's, which the native hybrid's test checks; Jamba, Qwen3-Next and the
# MTP tests verify with k = 2 on new kinds.
ARCH_K = {"recurrent_gemma": 3, "lfm2": 2}


class Oracle:
    """Drafts the reference continuation, corrupted: per draft a wrong token w.p. 0.3,
    and a random number of drafts (0..n) per call. Keyed by the prompt."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], vocab: int, seed: int = 0):
        self.refs, self.vocab = refs, vocab
        self.rng = np.random.default_rng(seed)

    def propose(self, tokens: list[int], n: int) -> list[int]:
        for prompt, ref in sorted(self.refs.items(), key=lambda kv: -len(kv[0])):
            if tuple(tokens[:len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                want = ref[done:done + int(self.rng.integers(0, n + 1))]
                return [t if self.rng.random() > 0.3 else (t + 1) % self.vocab for t in want]
        return []


def prompts_for(vocab: int, seed: int, lens=(21, 5, 30)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def spec_engine(lm, k: int, **kw) -> LLMEngine:
    cfg = EngineConfig(**(BASE | {"speculative_method": "ngram", "num_speculative_tokens": k} | kw))
    return LLMEngine(lm, cfg, show_progress=False)


def run(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in LLM.from_engine(eng).generate(prompt_token_ids=prompts,
                                                               sampling_params=params)]


def staggered(eng: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    """The first prompt alone until it decodes, then the others join (plain prefill steps
    interleave with verification steps)."""
    ids = [eng.add_request(prompt_token_ids=prompts[0], params=params)]
    out: dict[str, list[int]] = {ids[0]: []}
    for _ in range(3):
        for d in eng.step():
            out[d.request_id] += d.token_ids
    for p in prompts[1:]:
        ids.append(eng.add_request(prompt_token_ids=p, params=params))
        out[ids[-1]] = []
    while eng.has_unfinished():
        for d in eng.step():
            out[d.request_id] += d.token_ids
    return [out[i] for i in ids]


def assert_exercised(eng: LLMEngine) -> None:
    s = eng.stats()
    assert s["spec_verify_steps"] > 0 and s["spec_plain_steps"] > 0
    assert 0 < s["spec_accepted_tokens"] < s["spec_proposed_tokens"]


@pytest.fixture(scope="module")
def native():
    return native_hybrid()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for arch in ARCH_K:
        d = tmp_path_factory.mktemp(arch)
        build(arch, d, seed=0)
        out[arch] = loaded(str(d))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCH_K))
def test_greedy_with_speculation_equals_plain(models, arch):
    """Every architecture, k = 1..4, corrupted oracle drafts, prefills interleaved."""
    lm = models[arch]
    vocab = lm.config.vocab_size
    prompts = prompts_for(vocab, seed=ARCH_K[arch], lens=(30, 5))
    refs = [greedy_generate(lm.model, p, NEW) for p in prompts]
    eng = spec_engine(lm, ARCH_K[arch])
    eng.drafter = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, vocab)
    assert staggered(eng, prompts) == refs, arch
    assert_exercised(eng)


@pytest.fixture(scope="module")
def native_engine(native):
    return spec_engine(native, 3, enable_prefix_caching=True, prefix_state_stride=16)


def test_prefix_caching_batched_solo_and_preemption(native, native_engine):
    """Native hybrid, k=3, prefix caching on: a restored sequence speculates and gives the
    reference tokens; batched == solo; a pool too small for the batch preempts."""
    lm, eng = native, native_engine
    vocab = lm.config.vocab_size
    base = prompts_for(vocab, seed=7, lens=(40,))[0]
    prompts = [base, base[:33] + [3, 4, 5], base[:20] + [9]]
    refs = [greedy_generate(lm.model, p, NEW) for p in prompts]
    eng.drafter = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, vocab, seed=1)
    assert run(eng, prompts[:1]) == refs[:1]
    hits = eng.stats()["prefix_cache_hit_tokens"]
    assert run(eng, prompts[1:]) == refs[1:]  # batched, both resume from the cache
    assert eng.stats()["prefix_cache_hit_tokens"] > hits
    assert [run(eng, [p])[0] for p in prompts[1:]] == refs[1:]  # solo
    assert_exercised(eng)
    # 8 pages of 8 tokens for 3 sequences; speculation only while <= 2 run: with 3 running
    # the steps are the ordinary overlapped ones, then verification resumes.
    small = spec_engine(lm, 2, num_pages=9, speculative_disable_by_batch_size=2)
    small.drafter = Oracle({tuple(p): r for p, r in zip(prompts, refs, strict=True)}, vocab, seed=2)
    ids = [small.add_request(prompt_token_ids=p, params=GREEDY) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    overlapped = 0
    while small.has_unfinished():
        for d in small.step():
            out[d.request_id] += d.token_ids
        overlapped += len(small._inflight) > 0  # a step left running while the host went on
    assert [out[i] for i in ids] == refs
    assert overlapped > 0
    assert small.stats()["num_preemptions"] > 0
    assert small.stats()["spec_accepted_tokens"] > 0


def test_ngram_drafter_and_stops(native, native_engine):
    """Prompt lookup on a repetitive prompt; stop ids and max_tokens cut inside a verified
    run; seeded sampling is reproducible."""
    lm, eng = native, native_engine
    eng.drafter = NgramDrafter(3, 1, 3)
    prompt = prompts_for(lm.config.vocab_size, seed=11, lens=(8,))[0] * 4
    ref = greedy_generate(lm.model, prompt, 20)
    before = eng.stats()["spec_proposed_tokens"]
    assert run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)) == [ref]
    assert eng.stats()["spec_proposed_tokens"] > before
    stop = ref[9]
    cut = ref[:ref.index(stop) + 1]
    got = run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))
    assert got == [cut]
    assert run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)) == [ref[:5]]
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    assert run(eng, [prompt], seeded) == run(eng, [prompt], seeded)
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=5, max_tokens=12, ignore_eos=True)
    assert run(eng, [prompt], seeded) == run(eng, [prompt], seeded)
    class Silent:
        def propose(self, tokens, n):
            return []

    eng.drafter = Silent()  # nothing proposed: plain decode steps, no verification
    steps = eng.stats()["spec_verify_steps"]
    assert run(eng, [prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)) == [ref[:6]]
    assert eng.stats()["spec_verify_steps"] == steps
    assert NgramDrafter(3, 1, 3).propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert NgramDrafter(3, 2, 3).propose([5, 2, 3, 4, 1, 2], 3) == []


@pytest.mark.parametrize("top_k", [0, 4])
def test_acceptance_preserves_the_target_distribution(top_k):
    """Chi-square on a vocabulary of 6: tokens emitted by `accept` with a point-mass draft
    follow the target distribution (first position, and the next one given acceptance),
    with and without top-k."""
    from scipy.stats import chisquare

    rng = np.random.default_rng(top_k)
    v, n = 6, 40000
    logits = rng.normal(size=(3, v)) * 1.5  # positions 0..2 of the verified row
    temp = 0.8
    p = np.exp(logits / temp - np.max(logits / temp, axis=1, keepdims=True))
    if top_k:  # float64 reference of the filter: the top_k most likely tokens only
        p *= logits >= np.sort(logits, axis=1)[:, -top_k][:, None]
    p /= p.sum(axis=1, keepdims=True)  # float64 target
    drafts = (int(np.argsort(p[0])[-2]), int(np.argmax(p[1])))  # likely, not certain
    rows = SamplingArrays.from_rows([{"temperature": temp, "top_k": top_k, "seed": 1000 + i, "step": 3}
                                     for i in range(n)])
    tokens = jnp.tile(jnp.array([[0, *drafts]], jnp.int32), (n, 1))
    out, acc = jax.jit(accept)(jnp.tile(jnp.asarray(logits, jnp.float32)[None], (n, 1, 1)), tokens,
                               jnp.full((n,), 2, jnp.int32), rows)
    out, acc = np.asarray(out), np.asarray(acc)
    keep = p[0] > 0, p[1] > 0  # chi-square over the support; nothing outside it
    first = np.bincount(out[:, 0], minlength=v)
    assert first[~keep[0]].sum() == 0
    assert chisquare(first[keep[0]], p[0][keep[0]] * n).pvalue > 1e-3
    second = np.bincount(out[acc >= 1, 1], minlength=v)  # given the first draft was accepted: p[1]
    assert second[~keep[1]].sum() == 0
    assert chisquare(second[keep[1]], p[1][keep[1]] * second.sum()).pvalue > 1e-3
    assert abs((acc >= 1).mean() - p[0, drafts[0]]) < 0.01
    # Greedy rows accept exactly the argmax prefix.
    g = SamplingArrays.from_rows([{}])
    best = np.argmax(logits, axis=1)
    toks = jnp.array([[0, best[0], (best[1] + 1) % v]], jnp.int32)
    o, a = accept(jnp.asarray(logits, jnp.float32)[None], toks, jnp.array([2]), g)
    assert int(a[0]) == 1 and np.asarray(o)[0, :2].tolist() == [best[0], best[1]]


def test_random_accept_lengths_never_leak_a_rejected_token():
    """Stress: verify q=4 tokens per step with random acceptance; after every step each
    slot's state equals the plain ragged forward run over the accepted tokens only."""
    lm = native_hybrid()
    cfg, model, s, q, b = lm.config, lm.model, 8, 4, 3
    caches = init_caches(cfg, num_pages=(3 * 8 + 1,), page_size=s, num_slots=b + 1, dtype=jnp.float32)
    table = np.arange(1, 3 * 8 + 1, dtype=np.int32).reshape(b, 8)
    slots = np.arange(1, b + 1, dtype=np.int32)
    rng = np.random.default_rng(0)

    def batch(tokens: list[list[int]], starts: list[int]) -> RaggedBatch:
        """A ragged batch padded to b * q tokens (one shape: one compilation)."""
        lens = [len(t) for t in tokens]
        pos = np.concatenate([np.arange(st, st + n) for st, n in zip(starts, lens, strict=True)])
        row = np.repeat(np.arange(b), lens)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pad = b * q - len(pos)  # padding tokens past cu[b] write into the dummy page 0
        mapping = np.concatenate([table[row, pos // s] * s + pos % s, np.zeros(pad, np.int64)])
        return RaggedBatch(jnp.array(np.concatenate([*tokens, np.zeros(pad, np.int64)]), jnp.int32),
                           jnp.array(np.concatenate([pos, np.zeros(pad, np.int64)]), jnp.int32),
                           jnp.array(cu), jnp.array(np.add(starts, lens), jnp.int32), jnp.array(slots),
                           jnp.array(np.array(starts) > 0), (jnp.array(table),),
                           (jnp.array(mapping, jnp.int32),), jnp.array(cu[1:] - 1))

    plain = jax.jit(lambda c, bt: forward_ragged(model, bt, c, decode=False)[1])

    def verify_step(c, bt, a):
        _, written, cands = forward_verify(model, bt, c, q)
        return choose(written, cands, bt.slot_ids, a, cfg)

    verify = jax.jit(verify_step)
    seqs = [rng.integers(0, 128, q).tolist() for _ in range(b)]
    ver = plain(caches, batch(seqs, [0] * b))
    ref = ver
    starts = [q] * b
    for _ in range(6):
        rows = [rng.integers(0, 128, q).tolist() for _ in range(b)]
        acc = rng.integers(0, q, b)  # keep positions 0..acc: 1 + acc tokens
        ver = verify(ver, batch(rows, starts), jnp.array(acc, jnp.int32))
        kept = [r[:a + 1] for r, a in zip(rows, acc.tolist(), strict=True)]
        ref = plain(ref, batch(kept, starts))
        starts = [st + len(k) for st, k in zip(starts, kept, strict=True)]
        for x, y in zip(jax.tree.leaves(states_of(ver)), jax.tree.leaves(states_of(ref)), strict=True):
            np.testing.assert_allclose(np.asarray(x)[:, 1:], np.asarray(y)[:, 1:], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs, field", [
    ({"speculative_method": "medusa"}, "speculative_method"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ({"speculative_method": "ngram", "num_speculative_tokens": 4, "max_prefill_chunk": 4},
     "num_speculative_tokens"),
    ({"speculative_method": "draft"}, "speculative_model"),
    ({"speculative_model": "native-tiny"}, "speculative_model"),
    ({"speculative_method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"speculative_method": "ngram", "speculative_disable_by_batch_size": 0},
     "speculative_disable_by_batch_size"),
])
def test_bad_settings_are_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kwargs)


def perturbed(lm, scale: float = 0.08, seed: int = 1):
    """The same architecture with every weight nudged: a draft that agrees often, not always."""
    from flax import nnx

    from hybrid_jax.loading import LoadedModel

    graphdef, state = nnx.split(lm.model)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    state = jax.tree.map(lambda x: x + scale * jnp.std(x) * jax.random.normal(next(keys), x.shape, x.dtype),
                         state)
    return LoadedModel(nnx.merge(graphdef, state), lm.config, None, "draft")


@pytest.mark.slow
def test_draft_model_greedy_equals_plain(native, monkeypatch):
    """A perturbed copy of the native hybrid drafts (k=3): tokens equal the reference,
    some drafts are rejected, and every proposal equals the draft model's own greedy
    continuation (its state is re-synced correctly after rejections)."""
    import serving.engine.llm_engine as engine_mod
    import serving.spec_decode.draft_model as dm
    from serving.engine.engine_config import draft_bytes

    draft = perturbed(native)
    monkeypatch.setattr(dm, "load_model", lambda name, dtype, device=None: draft)
    monkeypatch.setattr(engine_mod, "load_model", lambda name, dtype, device=None: draft)
    prompts = prompts_for(128, seed=21, lens=(30, 5))
    refs = [greedy_generate(native.model, p, NEW) for p in prompts]
    eng = spec_engine(native, 3, speculative_method="draft", speculative_model="perturbed")
    # The memory plan counts exactly the caches the drafter holds.
    held = sum(x.nbytes for x in jax.tree.leaves((eng.drafter.runner.caches, eng.drafter.runner.stats)))
    assert draft_bytes(draft.config, eng.config, eng.plan.scheduler.max_model_len, jnp.float32) == held
    seen: list[tuple[list[int], list[int]]] = []
    propose = eng.drafter.propose_batch

    def record(work):
        out = propose(work)
        seen.extend((list(toks), d) for (_, toks, _), d in zip(work, out, strict=True) if d)
        return out

    eng.drafter.propose_batch = record
    assert staggered(eng, prompts) == refs
    assert_exercised(eng)
    assert len(seen) >= 4 and max(len(d) for _, d in seen) == 3  # chained decode steps ran
    for toks, d in seen[::2][:6]:  # proposals spread over the run, first ones included
        assert d == greedy_generate(draft.model, toks, len(d))
    with pytest.raises(ValueError, match="speculative_model"):
        bad = perturbed(native)
        small = lambda name, dtype, device=None: dataclasses.replace(  # noqa: E731
            bad, config=dataclasses.replace(bad.config, vocab_size=64))
        monkeypatch.setattr(dm, "load_model", small)
        monkeypatch.setattr(engine_mod, "load_model", small)
        spec_engine(native, 3, speculative_method="draft", speculative_model="small-vocab")


def test_draft_model_memory_is_planned_with_the_pools(native):
    """The draft model's weights and caches come out of the pool budget; a draft that leaves
    too little for one sequence is refused by name."""
    from serving.engine.engine_config import draft_bytes, plan_pools

    cfg = EngineConfig(max_num_seqs=100_000, max_model_len=512, speculative_method="draft",
                       speculative_model="d", num_speculative_tokens=3, memory_fraction=1.0)
    mb = 2**20
    free, weights, draft_w = 512 * mb, 4 * mb, 8 * mb
    plain = plan_pools(native.config, cfg, free_bytes=free, weight_bytes=weights, dtype=jnp.float32)
    with_draft = plan_pools(native.config, cfg, free_bytes=free, weight_bytes=weights,
                            dtype=jnp.float32, draft=(native.config, draft_w))
    need = draft_w + draft_bytes(native.config, cfg, 512, jnp.float32)
    def spent(p) -> int:  # pages and state slots the plan allocates
        pages = sum(g.num_pages * b for g, b in zip(p.scheduler.groups, p.page_bytes, strict=True))
        return pages + p.scheduler.num_slots * p.slot_bytes

    per_seq = spent(plain) / plain.scheduler.max_num_seqs  # memory binds: max_num_seqs lowered
    assert plain.scheduler.max_num_seqs < 100_000
    assert abs(spent(plain) - spent(with_draft) - need) <= 2 * per_seq
    with pytest.raises(ValueError, match="speculative_model='d'"):
        plan_pools(native.config, cfg, free_bytes=free, weight_bytes=weights,
                   dtype=jnp.float32, draft=(native.config, free))


def test_cli_flags_reach_the_engine_config():
    from serving.entrypoints.cli_args import build_parser
    from serving.entrypoints.cli_commands import spec_kwargs

    for cmd in (["generate", "hi"], ["serve"]):
        args = build_parser().parse_args([*cmd, "--speculative-method", "draft",
                                          "--num-speculative-tokens", "2",
                                          "--speculative-model", "native-tiny",
                                          "--speculative-disable-by-batch-size", "0"])
        cfg = EngineConfig(**spec_kwargs(args))
        assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.speculative_model,
                cfg.speculative_disable_by_batch_size) == ("draft", 2, "native-tiny", None)
        args = build_parser().parse_args([*cmd, "--num-scheduler-steps", "6", "--multi-step-max-seqs", "2"])
        cfg = EngineConfig(**spec_kwargs(args))
        assert (cfg.num_scheduler_steps, cfg.multi_step_max_seqs, cfg.multi_q) == (6, 2, 6)


def test_a_stop_string_inside_an_accepted_run_cuts_the_run():
    """Tokens after the one completing a stop string are dropped (from the sequence too)."""
    from hybrid_jax.loading import load_model
    from serving.core.sequence import Sequence
    from serving.engine.detokenizer import IncrementalDetokenizer

    tok = load_model("default").tokenizer
    prompt = tok.encode("def f(x):", add_bos=True)
    run_ids = tok.encode("\n    return x + 1\n", add_bos=False)
    seq = Sequence("r", prompt, SamplingParams(stop=["return"]))
    seq.token_ids += run_ids
    detok = IncrementalDetokenizer(tok, prompt, ["return"])
    text, kept = LLMEngine._add_run(seq, detok, run_ids)
    assert detok.stopped_on == "return" and len(kept) < len(run_ids)
    assert "return" in tok.decode(kept) and "return" not in tok.decode(kept[:-1])
    assert seq.token_ids == prompt + kept and "return" not in text


def test_verification_executables_alias_their_results(native_engine):
    """The verification executables write their results into donated buffers (the runner
    reuses them call after call: serving/runner/result_buffers.py)."""
    from tests.serving.test_output_buffers import assert_results_aliased

    r = native_engine.runner
    assert r.verifiers
    for (bucket, _), exe in r.verifiers.items():
        assert_results_aliased(exe, r.caches, r.results.sync_shapes("verify", bucket))
