"""FP8 KV cache (`kv_cache_dtype="fp8"`) in the engine, on the tiny native hybrid (parallel
hybrid, SWA-only and Mamba2 layers; window 16, pages of 8).

One FP8 engine (per-head scales, prefix caching on) serves three prompts batched (misses),
then the first alone (a prefix-cache hit) and again beside a new prompt (a hit, batched):
greedy tokens identical and logprobs within 1e-5 (the fp8 engine's own invariants, exact).
Against the f32-KV engine, the rule for "close": every request's first token equal, and
at least 3/4 of all greedy tokens equal position by position (FP8 rounding, 2^-4 relative,
may flip a near-tie of a random model's flat logits later on), and the first token's
logprob within 0.05. The same page count takes a quarter of f32's KV bytes, and the same
memory plans more pages and sequences; stats() reports the pages' dtype.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybrid_jax.kv_quant import calibrate_kv_scales
from serving.engine.engine_config import EngineConfig, plan_pools
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams
from tests.serving.test_engine_parity import native_hybrid

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16, max_model_len=64,
                   page_size=8, seq_buckets=(4,), token_buckets=(32,), num_pages=40)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def lm():
    return native_hybrid()


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(0, vocab, n).tolist() for n in (21, 9, 30, 17)]


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids
    for la, lb in zip(a.logprobs, b.logprobs, strict=True):
        assert la.keys() == lb.keys()
        np.testing.assert_allclose([la[k] for k in lb], [lb[k] for k in lb], rtol=1e-5, atol=1e-6)


def test_fp8_kv_engine(lm):
    p = _prompts(lm.config.vocab_size)
    fp8 = LLM.from_engine(LLMEngine(lm, dataclasses.replace(CFG, kv_cache_dtype="fp8",
                                                            enable_prefix_caching=True),
                                    show_progress=False))
    batched = fp8.generate(prompt_token_ids=p[:3], sampling_params=GREEDY)
    solo_hit = fp8.generate(prompt_token_ids=[p[0]], sampling_params=GREEDY)[0]
    batched_hit = fp8.generate(prompt_token_ids=[p[3], p[0]], sampling_params=GREEDY)
    _same(solo_hit, batched[0])
    _same(batched_hit[1], batched[0])
    stats = fp8.engine.stats()
    assert stats["prefix_cache_hit_tokens"] >= 2 * 16 and stats["kv_cache_dtype"] == "float8_e4m3fn"

    ref = LLM.from_engine(LLMEngine(lm, CFG, show_progress=False))
    want = ref.generate(prompt_token_ids=p[:3], sampling_params=GREEDY)
    assert ref.engine.stats()["kv_cache_dtype"] == "float32"
    equal = sum(x == y for a, b in zip(batched, want, strict=True)
                for x, y in zip(a.token_ids, b.token_ids, strict=True))
    assert all(a.token_ids[0] == b.token_ids[0] for a, b in zip(batched, want, strict=True))
    assert equal >= 0.75 * 3 * GREEDY.max_tokens, equal
    for a, b in zip(batched, want, strict=True):
        t = b.token_ids[0]
        assert abs(a.logprobs[0][t] - b.logprobs[0][t]) < 0.05
    # FP8 pages are a quarter of f32's bytes: same pages, a quarter of the KV bytes
    assert fp8.engine.plan.kv_bytes * 4 == ref.engine.plan.kv_bytes


def test_fp8_kv_planning_scales_and_refusals(lm):
    sized = dataclasses.replace(CFG, num_pages=None, memory_fraction=0.5, max_num_seqs=64)
    plan = {d: plan_pools(lm.config, dataclasses.replace(sized, kv_cache_dtype=d), free_bytes=5 * 2**17,
                          weight_bytes=0, dtype=np.float32) for d in ("auto", "fp8")}
    # the same memory holds more pages (and sequences): FP8 pages take a quarter of f32's bytes
    assert all(4 * b == a for a, b in zip(plan["auto"].page_bytes, plan["fp8"].page_bytes, strict=True))
    assert all(f.num_pages > 2 * a.num_pages for f, a in zip(plan["fp8"].scheduler.groups,
                                                            plan["auto"].scheduler.groups, strict=True))
    assert plan["fp8"].scheduler.max_num_seqs > plan["auto"].scheduler.max_num_seqs
    head = calibrate_kv_scales(lm.model, "head")
    tensor = calibrate_kv_scales(lm.model, "tensor")
    for (kh, vh), (kt, vt) in zip(head, tensor, strict=True):
        assert kh.shape == kt.shape == (lm.config.attention.num_kv_heads, kh.shape[1])
        assert (kh > 0).all() and (kh <= kt).all() and np.allclose(kt, kt.max(axis=0))  # one per layer
        assert np.allclose(kt.max(axis=0), kh.max(axis=0)) and np.allclose(vt.max(axis=0), vh.max(axis=0))
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_scale='token'"):
        EngineConfig(kv_cache_dtype="fp8", kv_scale="token")
    EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2)  # runs tensor-parallel (scales split)


def test_cli_subcommands_take_kv_cache_dtype():
    from serving.entrypoints.cli_args import build_parser

    for command, rest in (("generate", ["x"]), ("serve", [])):
        args = build_parser().parse_args([command, "--kv-cache-dtype", "fp8", "--kv-scale", "tensor", *rest])
        assert (args.kv_cache_dtype, args.kv_scale) == ("fp8", "tensor")
        args = build_parser().parse_args([command, *rest])
        assert (args.kv_cache_dtype, args.kv_scale) == ("auto", "head")
