"""The benchmarks' arithmetic against brute force and hand counts: pages a sliding-window
sequence needs, the byte floor of a decode step, length distributions, argument parsing."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_jax.presets import load_preset
from serving.entrypoints.bench.common import LengthDist, parse_ints, summarize
from serving.entrypoints.bench.floor import decode_floor_bytes
from serving.entrypoints.bench.memory import fit_batch, swa_pages


@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 64])
@pytest.mark.parametrize("page", [1, 8, 16])
def test_swa_pages_equal_the_pages_of_every_position_the_next_query_reads(window, page):
    for cached in range(0, 200, 7):
        reads = [k for k in range(cached) if window is None or k > cached - window]
        pages = {k // page for k in reads}
        if cached % page:  # the partly filled page the next token is written into
            pages.add(cached // page)
        assert swa_pages(window, cached, page) == len(pages), (cached, window, page)


def test_decode_floor_counts_weights_window_kv_and_state_by_hand():
    cfg = load_preset("native-tiny")  # 4 hybrid layers, W 64, kv 2 x 32, Mamba2 4 x 32 x 16, conv 4
    b, ctx = 3, 100
    got = decode_floor_bytes(cfg, batch=b, context=ctx, weight_bytes=1000, dtype="bfloat16")
    kv = 4 * b * 64 * 2 * 2 * 32 * 2  # layers * batch * window keys * (K, V) * heads * dim * bf16
    conv_dim = 4 * 32 + 2 * 16
    state = 4 * 2 * b * (4 * 32 * 16 * 4 + 3 * conv_dim * 2)  # read + write, f32 SSM, bf16 conv
    assert got == {"weights": 1000, "kv": kv, "state": state, "total": 1000 + kv + state}
    short = decode_floor_bytes(cfg, batch=b, context=9, weight_bytes=1000, dtype="bfloat16")
    assert short["kv"] == kv * 10 // 64  # below the window: the cached tokens and the new one


def test_decode_floor_counts_gated_deltanet_state_by_hand():
    cfg = load_preset("qwen3.5-35b-a3b")  # 30 Gated DeltaNet layers, 10 global attention layers
    b, ctx = 2, 999
    held = 70 * 10**9  # every weight (the floor keeps the touched experts' share)
    got = decode_floor_bytes(cfg, batch=b, context=ctx, weight_bytes=held, dtype="bfloat16")
    conv_dim = 2 * 16 * 128 + 32 * 128  # q, k (16 key heads) and v (32 value heads) of 128
    state = 30 * 2 * b * (32 * 128 * 128 * 4 + 3 * conv_dim * 2)  # read + write, f32 rule, bf16 conv
    kv = 10 * b * (ctx + 1) * 2 * 2 * 256 * 2  # global layers: every cached key, 2 KV heads of 256
    weights = held - cfg.vocab_size * 2048 * 2 + b * 2048 * 2  # untied: the input rows gathered
    # 40 MoE layers of 256 experts (gate, up, down of 2048 x 512): two tokens' top-8 sets
    # touch 16 experts less the expected overlap 8 * 8 / 256 = 0.25
    weights -= int(40 * (256 - (16 - 8 * 8 / 256)) * 3 * 2048 * 512 * 2)
    assert got == {"weights": weights, "kv": kv, "state": state, "total": weights + kv + state}


def test_fit_batch_grows_with_budget_and_is_flat_in_context_past_the_window():
    cfg = load_preset("native-1b-parallel")
    kw = {"page_size": 16, "dtype": "bfloat16", "prefill_chunk": 4096}
    at_32k = fit_batch(cfg, context=32768, budget_bytes=60e9, **kw)
    assert at_32k == fit_batch(cfg, context=131072, budget_bytes=60e9, **kw) > 100
    assert fit_batch(cfg, context=32768, budget_bytes=30e9, **kw) < at_32k


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist(7).sample(3, rng) == [7, 7, 7]
    u = LengthDist(100, "uniform", 0.5).sample(2000, rng)
    assert min(u) >= 50 and max(u) <= 150 and abs(np.mean(u) - 100) < 3
    lg = LengthDist(100, "lognormal", 1.0).sample(2000, rng)
    assert min(lg) >= 1 and max(lg) <= 400 and 80 < np.median(lg) < 120
    with pytest.raises(ValueError, match="dist='poisson'"):
        LengthDist(10, "poisson")
    with pytest.raises(ValueError, match="ratio=1.0"):
        LengthDist(10, "uniform", 1.0)


def test_parse_ints_and_summaries():
    assert parse_ints("1024, 4k,1M", "--contexts") == (1024, 4096, 1 << 20)
    with pytest.raises(ValueError, match="--contexts"):
        parse_ints("4k,x", "--contexts")
    s = summarize([1.0, 2.0, 3.0, 4.0], scale=1e3)
    assert s == {"count": 4, "mean": 2500.0, "p50": 2500.0, "p90": pytest.approx(3700.0),
                 "p99": pytest.approx(3970.0)}
    assert summarize([]) == {"count": 0}
