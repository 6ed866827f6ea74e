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


def test_peak_output_rate_counts_tokens_per_second_window_by_hand():
    from serving.entrypoints.bench.load import Record, peak_output_tok_s

    # Sent at 10.0. A: 4 one-token messages at 10.1, 10.2, 11.5, 11.6; B: 2 messages of 3
    # tokens each (an OpenAI chunk may carry several) at 10.9 and 12.0. Windows from 10.0:
    # [10, 11) holds 1 + 1 + 3 = 5 tokens, [11, 12) 2, [12, 13) 3.
    a = Record(5, 4, sent=10.0, token_times=[10.1, 10.2, 11.5, 11.6], output_tokens=4, end=11.6)
    b = Record(5, 6, sent=10.0, token_times=[10.9, 12.0], output_tokens=6, end=12.0)
    assert peak_output_tok_s([a, b]) == pytest.approx(5.0)
    assert peak_output_tok_s([a, b], window_s=2.0) == pytest.approx(7 / 2)  # [10, 12): 7 tokens
    assert peak_output_tok_s([]) == 0.0


def test_reference_workload_table_and_flags():
    import argparse

    from benchmarks.reference_workload import VLLM, bench_command, format_table, serve_command, table
    from serving.entrypoints.bench.args import add_args

    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args(["serving", "--max-concurrency", "16"]).concurrency == 16  # vLLM's flag name
    res = {"completed": 510, "failed": 2, "duration_s": 100.0, "request_throughput": 5.1,
           "output_tok_s": 2000.0, "peak_output_tok_s": 2500.0, "total_tok_s": 20000.0,
           "ttft_ms": {"mean": 90.0, "p50": 80.0, "p99": 900.0},
           "tpot_ms": {"mean": 7.0, "p50": 6.5, "p99": 8.0},
           "itl_ms": {"count": 0}, "e2e_ms": {"mean": 4000.0, "p50": 3900.0, "p99": 5000.0}}
    rows = {name: (ours, theirs) for name, ours, theirs in table(res)}
    assert rows["Output token throughput (tok/s)"] == (2000.0, VLLM["output_tok_s"])
    assert rows["TTFT median (ms)"] == (80.0, 84.0) and rows["TPOT p99 (ms)"] == (8.0, 7.95)
    assert rows["ITL mean (ms)"] == (None, None)  # no ITL samples: left empty, not zero
    assert "Spec. acceptance rate" not in rows  # only with speculation's gauges
    gauges = {"spec_acceptance_rate": 0.01, "spec_mean_accepted_length": 1.02}
    spec = {name: v for name, v, _ in table(res | gauges)}
    assert spec["Spec. mean accepted length (tokens/step)"] == 1.02
    text = format_table(table(res))
    assert "2,300.00" in text and "Failed requests" in text
    a = argparse.Namespace(model="qwen3.5-35b-a3b", tp=2, max_num_seqs=64, max_model_len=8192,
                           max_num_batched_tokens=8192, num_requests=512, memory_fraction=0.9,
                           quantization="fp8", speculative_tokens=2, serve_args=[], max_concurrency=16,
                           input_len=4400, output_len=512, range_ratio=0.1, background_compile=False)
    serve = " ".join(serve_command(a))
    for flag in ("--tensor-parallel-size 2", "--enable-prefix-caching", "--max-num-seqs 64", "--http-port 0",
                 "--quantization fp8", "--speculative-method mtp --num-speculative-tokens 2",
                 "--no-background-compile"):
        assert flag in serve, flag
    a.background_compile = True
    assert "--no-background-compile" not in serve_command(a)
    bench = " ".join(bench_command(a, 8000, "out"))
    for flag in ("--backend openai", "--server http://127.0.0.1:8000", "--max-concurrency 16",
                 "--num-requests 512", "--input-len 4400", "--output-len 512"):
        assert flag in bench, flag


def test_mla_kv_bytes_are_the_latent_rows():
    """Kimi Linear's MLA pages hold one latent row per token and layer (512 + 64 values, no
    V): the floor, the memory arithmetic and the engine's own page sizes agree by hand."""
    import jax.numpy as jnp

    from hybrid_jax.cache import cache_bytes
    from serving.entrypoints.bench.memory import page_bytes

    cfg = load_preset("kimi-linear-48b-a3b")  # 7 MLA layers, kv_lora_rank 512, qk_rope 64
    b, ctx = 2, 99
    got = decode_floor_bytes(cfg, batch=b, context=ctx, weight_bytes=10**11, dtype="bfloat16")
    assert got["kv"] == 7 * b * (ctx + 1) * 576 * 2
    assert page_bytes(cfg, 16, "bfloat16") == (7 * 16 * 576 * 2,)
    assert cache_bytes(cfg, page_size=16, dtype=jnp.bfloat16)[0] == (7 * 16 * 576 * 2,)


def test_measured_touched_experts_counts_the_models_own_routing():
    """The decode floor's experts from the model's routing (record_routing over a forward):
    a router that sends every token to the same experts touches top_k of them at any batch,
    a random one touches what a direct count of its `route` choices on the same hidden
    states gives, and the count is the same whatever the grouping of sequences."""
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.layers.moe import MoE
    from hybrid_jax.model import CausalLM
    from serving.entrypoints.bench.floor import measured_touched_experts

    cfg = load_preset("qwen3.5-moe-tiny")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (9, 14, 6, 11, 12)]
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    moes = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
    k, e = cfg.moe.top_k, cfg.moe.num_experts
    got = measured_touched_experts(model, seqs, steps=3, group=2)
    assert got == measured_touched_experts(model, seqs, steps=3, group=8)
    # Direct count: hidden states before each trunk MoE layer's call, routed by hand.
    seen: list[np.ndarray] = []

    def recording(route):
        def wrapped(x):
            weights, experts = route(x)
            seen.append(np.asarray(experts))
            return weights, experts
        return wrapped

    trunk = [m for p, m in nnx.iter_graph(model) if isinstance(m, MoE) and p[0] == "layers"]
    for m in trunk:
        m.route = recording(m.route)
    lens = np.array([len(s) for s in seqs])
    tokens = np.zeros((len(seqs), lens.max()), np.int32)
    for i, s in enumerate(seqs):
        tokens[i, :len(s)] = s
    model.hidden(jnp.asarray(tokens))
    for m in trunk:
        del m.route
    rows = np.arange(len(seqs))
    counts = [len(np.unique(x.reshape(len(seqs), lens.max(), k)[rows, lens - j]))
              for x in seen for j in (1, 2, 3)]
    assert got == pytest.approx(np.mean(counts))
    assert k <= got <= min(e, k * len(seqs))
    for m in moes:  # every token to experts 0..k-1 (equal logits: top_k takes the lowest)
        m.router[...] = jnp.zeros_like(m.router[...])
    assert measured_touched_experts(model, seqs, steps=3) == k


def test_measured_touched_experts_checks_the_sequences_are_the_models_greedy_ones():
    """`check`: sequences the model continued greedily itself agree with its forward's
    argmax at every checked position; random tokens do not."""
    import jax.numpy as jnp
    from flax import nnx

    from hybrid_jax.model import CausalLM
    from serving.entrypoints.bench.floor import measured_touched_experts

    cfg = load_preset("qwen3.5-moe-tiny")
    model = CausalLM(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(2)
    seqs = []
    for n in (5, 8, 6):
        toks = rng.integers(3, cfg.vocab_size, n).tolist()
        for _ in range(4):  # greedy continuation by the reference forward
            toks.append(int(jnp.argmax(model(jnp.asarray([toks]))[0, -1])))
        seqs.append(toks)
    check: dict = {}
    measured_touched_experts(model, seqs, steps=4, group=2, check=check)
    assert check["greedy_agree"] == 1.0 and check["distinct_last_tokens"] == len({s[-1] for s in seqs})
    noise = [rng.integers(3, cfg.vocab_size, 9).tolist() for _ in range(3)]
    measured_touched_experts(model, noise, steps=4, group=2, check=check)
    assert check["greedy_agree"] < 0.5
