"""Bucket ladders: decode buckets padded to a row floor (8 on GPUs, where fewer rows make
XLA lower the projections to slow reduction fusions) serve exactly what unpadded ones do."""

from __future__ import annotations

import threading

import jax

import serving.runner.runner as runner_mod
from hybrid_jax.layers import linear
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.runner.runner import Bucket, late_buckets, make_buckets
from serving.sample.sampling_params import SamplingParams


def test_decode_buckets_take_the_row_floor_and_mixed_buckets_do_not():
    assert make_buckets(1, 64, min_tokens=16, min_decode_rows=8) == [
        Bucket(8, 8, True), Bucket(16, 1, False), Bucket(64, 1, False)]
    # The default token ladder starts at 64 (x4 up to the limit), sequences at 8 (x2).
    assert make_buckets(32, 512) == [Bucket(b, b, True) for b in (8, 16, 32)] + [
        Bucket(t, b, False) for t in (64, 256, 512) for b in (8, 16, 32)]
    assert make_buckets(32, 512) == make_buckets(32, 512, min_decode_rows=8)  # ladder starts at 8
    decode = [b for b in make_buckets(4, 64, seq_sizes=(1, 2, 4), min_decode_rows=8) if b.decode]
    assert decode == [Bucket(8, 8, True)]  # 1, 2 and 4 rows all pad to one 8-row bucket
    assert [b.seqs for b in make_buckets(4, 64, seq_sizes=(1, 2, 4)) if b.decode] == [1, 2, 4]


def test_single_row_decode_bucket():
    """One row beside the padded ladder; alone when max_num_seqs is 1."""
    decode = lambda *a, **k: [b for b in make_buckets(*a, **k) if b.decode]
    assert decode(1, 64, min_decode_rows=8, single_row_decode=True) == [Bucket(1, 1, True)]
    assert decode(32, 512, min_decode_rows=8, single_row_decode=True) == [
        Bucket(b, b, True) for b in (1, 8, 16, 32)]
    assert decode(4, 64, seq_sizes=(1, 2, 4), min_decode_rows=8, single_row_decode=True) == [
        Bucket(1, 1, True), Bucket(8, 8, True)]


def test_one_sequence_in_an_eight_row_decode_bucket_equals_a_one_row_bucket(monkeypatch):
    """Also the one-row bucket of a fused model whose one-row projections are reductions
    (forced on the CPU: `linear.REDUCTION_GEMV_ANY_BACKEND`), beside a padded ladder."""
    lm = load_model("native-tiny")
    max_seqs = 1
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [1, 5, 9, 13, 7, 22, 3, 40, 41]

    def serve(floor: int, single_row: bool = False, steps: int = 1) -> tuple[list[int], list[Bucket]]:
        monkeypatch.setattr(runner_mod, "decode_row_floor", lambda: floor)
        monkeypatch.setattr(runner_mod, "reduction_gemv", lambda: single_row)
        cfg = EngineConfig(max_num_seqs=max_seqs, max_num_batched_tokens=16, max_prefill_chunk=16,
                           max_model_len=64, num_pages=16, num_scheduler_steps=steps)
        engine = LLMEngine(lm, cfg, show_progress=False)
        assert engine.runner.transposed and engine.runner.single_row == single_row
        used = []
        pick = engine.runner.pick
        engine.runner.pick = lambda arrays: used.append(pick(arrays)) or used[-1]
        engine.add_request(prompt_token_ids=prompt, request_id="a", params=params)
        out = []
        while engine.has_unfinished():
            for d in engine.step():
                out.extend(d.token_ids)
        if steps > 1:  # one sequence: its multi-step calls take the one-row bucket if there
            assert engine.stats()["multi_step_calls"] > 0
            used.extend(engine.runner.multi_buckets[:1])
        return out, used

    plain, used1 = serve(1)
    padded, used8 = serve(8)
    assert Bucket(1, 1, True) in used1 and Bucket(8, 8, True) in used8
    assert len(plain) == 12 and padded == plain
    jax.clear_caches()  # the reduction switch is read when the step traces
    monkeypatch.setattr(linear, "REDUCTION_GEMV_ANY_BACKEND", True)
    max_seqs = 4
    reduced, used_r = serve(8, single_row=True)
    jax.clear_caches()
    assert Bucket(1, 1, True) in used_r and Bucket(8, 8, True) not in used_r
    assert reduced == plain
    multi, used_m = serve(8, single_row=True, steps=4)  # multi-step calls of one-row forwards
    jax.clear_caches()
    assert Bucket(4, 1, False, True) in used_m and multi == plain


def test_coarse_mixed_ladder_keeps_decode_buckets_and_thins_mixed_ones():
    fine = make_buckets(256, 8192, min_decode_rows=8)
    coarse = make_buckets(256, 8192, min_decode_rows=8, coarse_mixed=True)
    assert [b for b in coarse if b.decode] == [b for b in fine if b.decode]
    mixed = [(b.tokens, b.seqs) for b in coarse if not b.decode]
    assert mixed == [(t, s) for t in (256, 512, 768, 1024, 4096, 8192) for s in (16, 64, 256)]
    # a limit below a rung closes the ladder there
    capped = make_buckets(64, 600, coarse_mixed=True)
    assert sorted({b.tokens for b in capped if not b.decode}) == [256, 512, 600]
    # Every mixed step the fine ladder serves has a coarse bucket that holds it.
    for b in fine:
        assert any(c.tokens >= b.tokens and c.seqs >= b.seqs and c.decode == b.decode for c in coarse)
    # Explicit ladders are kept as given.
    assert make_buckets(64, 512, seq_sizes=(8, 64), token_sizes=(128, 512), coarse_mixed=True) == \
        make_buckets(64, 512, seq_sizes=(8, 64), token_sizes=(128, 512))


def test_warmup_runs_every_bucket_and_changes_no_output():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
                       max_model_len=96, page_size=8)
    engine = LLMEngine("native-tiny", cfg, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[1, 5, 9, 13, 7, 22, 3, 40, 41, 2, 8, 30, 31, 17, 19, 23, 6], [4, 4, 2], [9, 1]]

    def generate() -> list[list[int]]:
        ids = [engine.add_request(prompt_token_ids=p, params=params) for p in prompts]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for d in engine.step():
                out[d.request_id].extend(d.token_ids)
        return [out[i] for i in ids]

    before = generate()
    launched = []
    launch = engine.runner._launch
    engine.runner._launch = lambda bucket, *a, **k: launched.append(bucket) or launch(bucket, *a, **k)
    engine.runner.warmup()
    assert launched == engine.runner.buckets and {b.decode for b in launched} == {True, False}
    stats = engine.stats()
    assert set(stats["pages_in_use"].values()) == {0} and stats["slots_in_use"] == 0
    assert generate() == before


def test_larger_executables_compile_in_the_background_while_smaller_ones_serve(monkeypatch):
    """compile_in_background: the engine serves within the start-up limits (4 sequences
    here) until the larger executables arrive, then lifts them; every
    request's greedy tokens equal its solo run's."""
    import threading

    lm = load_model("native-tiny")
    monkeypatch.setattr(LLMEngine, "STARTUP_SEQS", 4)
    monkeypatch.setattr(LLMEngine, "STARTUP_TOKENS", 16)
    gate = threading.Event()
    later = runner_mod.compile_later

    def held(jobs, **kw):  # the background compile waits for the test's go
        return later([(k, lambda lo=lo: gate.wait() and lo(), sk, a) for k, lo, sk, a in jobs], **kw)

    monkeypatch.setattr(runner_mod, "compile_later", held)
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, max_prefill_chunk=16, max_model_len=96,
                       seq_buckets=(4, 8), token_buckets=(16,), compile_in_background=True)
    engine = LLMEngine(lm, cfg, show_progress=False)
    first = {Bucket(4, 4, True), Bucket(16, 4, False)}
    assert set(engine.runner.compiled) == first and set(engine.runner.samplers) == {4}
    assert engine.runner.startup["deferred"] == 3  # the 8-row decode, (16 tokens, 8 rows), sampler 8
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (4, 16)
    used: list[Bucket] = []
    pick = engine.runner.pick
    engine.runner.pick = lambda arrays: used.append(pick(arrays)) or used[-1]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[3 + i, 9, 27 + i, 5] * (3 + i % 3) for i in range(8)]
    out: dict[str, list[int]] = {}

    def run() -> None:
        while engine.has_unfinished():
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)

    for i, p in enumerate(prompts):
        engine.add_request(prompt_token_ids=p, request_id=str(i), params=params)
    for _ in range(6):  # within the limits: at most 4 running
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
        assert len(engine.scheduler.running) <= 4
    assert set(used) <= first and not engine.background_ready()
    gate.set()
    while not engine.background_ready():
        gate.wait(0.05)
    run()
    assert engine.deferred_ready_s is not None and not engine.runner.deferred
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (8, 16)
    assert set(engine.runner.compiled) == set(engine.runner.buckets)
    batched = dict(out)
    for i, p in enumerate(prompts):  # all 8 at once now: the 8-sequence executables serve
        engine.add_request(prompt_token_ids=p, request_id=f"b{i}", params=params)
    used.clear()
    run()
    assert any(b.seqs == 8 for b in used)
    for i, p in enumerate(prompts):
        engine.add_request(prompt_token_ids=p, request_id=f"s{i}", params=params)
        run()
    assert all(len(batched[str(i)]) == 8 for i in range(8))
    assert [batched[str(i)] for i in range(8)] == [out[f"b{i}"] for i in range(8)] == [
        out[f"s{i}"] for i in range(8)]


def test_padding_rungs_are_the_gpu_ladders_512_and_768_token_mixed_buckets():
    coarse = make_buckets(64, 2048, min_decode_rows=8, coarse_mixed=True)
    late = late_buckets(coarse, True)
    assert {(b.tokens, b.seqs) for b in late} == {(t, s) for t in (512, 768) for s in (16, 64)}
    assert not any(b.decode for b in late) and not late_buckets(coarse, False)
    # start-up (64 sequences, 1024 tokens) compiles the mixed rungs it did before they existed
    first = {b.tokens for b in coarse if not b.decode and b.tokens <= 1024 and b not in late}
    assert first == {256, 1024}


def test_the_top_rung_is_never_late():
    buckets = make_buckets(64, 768, coarse_mixed=True)
    late = late_buckets(buckets, True)
    assert [b.tokens for b in buckets if not b.decode and b in late] == [512, 512]


def test_a_late_rung_compiles_in_the_background_and_changes_no_output(monkeypatch):
    """Until a padding-only rung arrives, its steps run in the next larger bucket."""
    lm = load_model("native-tiny")
    monkeypatch.setattr(LLMEngine, "STARTUP_SEQS", 4)
    monkeypatch.setattr(LLMEngine, "STARTUP_TOKENS", 32)
    sixteen = lambda buckets, coarse: frozenset(b for b in buckets if not b.decode and b.tokens == 16)
    monkeypatch.setattr(runner_mod, "late_buckets", sixteen)
    later = runner_mod.compile_later
    gate = threading.Event()

    def held(jobs, **kw):
        return later([(k, lambda lo=lo: gate.wait() and lo(), sk, a) for k, lo, sk, a in jobs], **kw)

    monkeypatch.setattr(runner_mod, "compile_later", held)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=32, max_model_len=96,
                       seq_buckets=(4,), token_buckets=(16, 32), compile_in_background=True)
    engine = LLMEngine(lm, cfg, show_progress=False)
    assert Bucket(16, 4, False) not in engine.runner.compiled
    assert Bucket(32, 4, False) in engine.runner.compiled
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (4, 32)
    used: list[Bucket] = []
    pick = engine.runner.pick
    engine.runner.pick = lambda arrays: used.append(pick(arrays)) or used[-1]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def generate(tag: str) -> list[list[int]]:
        out: dict[str, list[int]] = {}
        for i in range(3):
            engine.add_request(prompt_token_ids=[3 + i, 9, 27, 5 + i] * 3, request_id=f"{tag}{i}",
                               params=params)
        while engine.has_unfinished():
            for d in engine.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        return [out[f"{tag}{i}"] for i in range(3)]

    before = generate("a")  # 3 prompts of 12 tokens: one 36-token step would not fit 32
    assert Bucket(32, 4, False) in used and Bucket(16, 4, False) not in used
    gate.set()
    while not engine.background_ready():
        gate.wait(0.05)
    engine.install_background()
    used.clear()
    after = generate("b")
    assert Bucket(16, 4, False) in used and before == after
