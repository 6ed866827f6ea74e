"""The executables write their results into donated buffers that the runner cycles
(serving/result_buffers.py): every executable aliases them (XLA keeps the step's
temporaries out of them, so a CUDA graph's nodes stay valid between calls), and the
buffers are reused across steps without ever handing a result still to be read, or the
next step's fed tokens, to a new call. Outputs themselves are checked against the
synchronous loop and the full forward elsewhere (test_overlap, test_engine_parity);
here the decoding through the cycled buffers is checked against the engine built
without any cycling (fresh buffers each call)."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import numpy as np
import pytest

from serving.engine import LLMEngine
from serving.engine_config import EngineConfig
from serving.sampling_params import SamplingParams

CFG = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_prefill_chunk=16,
                   max_model_len=128, page_size=8, num_scheduler_steps=3)


_IDS = itertools.count()


@pytest.fixture(scope="module")
def built():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = LLMEngine("native-tiny", CFG, show_progress=False)
    return engine, [str(w.message) for w in caught]


def test_every_donated_output_is_used(built):
    """JAX warns when a donated buffer matches no result: then XLA would allocate the
    result afresh (and place temporaries in it) while the donated buffer is wasted."""
    engine, caught = built
    assert not [m for m in caught if "donated" in m], caught
    r = engine.runner
    assert r.compiled and r.multisteps
    for exe in [*r.compiled.values(), *r.multisteps.values()]:
        text = exe.as_text()
        header = text[:text.index("\n")]
        assert "input_output_alias" in header


def test_speculative_executables_alias_their_outputs():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = LLMEngine("native-tiny", dataclasses.replace(
            CFG, num_scheduler_steps=1, speculative_method="ngram", num_speculative_tokens=2),
            show_progress=False)
    assert not [str(w.message) for w in caught if "donated" in str(w.message)]
    assert engine.runner.verifiers


def _drive(engine, prompts, params):
    ids = [f"b{next(_IDS)}" for _ in prompts]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(prompt_token_ids=p, params=params, request_id=rid)
    out = {i: [] for i in ids}
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id] += d.token_ids
    return [out[i] for i in ids]


def test_buffers_cycle_and_outputs_match_fresh_buffers(server_engine, monkeypatch):
    """In the overlapped decode loop the logits buffer of a row count is the same buffer
    every call and the sample buffers alternate between two (addresses checked); the
    tokens equal those of the same engine whose runner allocates fresh buffers each call."""
    engine = server_engine  # one step per call (no multi-step)
    r = engine.runner
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 9, 14, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    seen: dict[int, list[tuple[int, int]]] = {}
    orig = r.results.take

    def spy(bs, fed):
        logits, plain = orig(bs, fed)
        seen.setdefault(bs, []).append((logits.unsafe_buffer_pointer(), plain[0].unsafe_buffer_pointer()))
        return logits, plain

    monkeypatch.setattr(r.results, "take", spy)
    cycled = _drive(engine, prompts, params)
    steps = max(seen.values(), key=len)
    assert len(steps) >= 8
    tail = steps[3:]
    assert len({lg for lg, _ in tail}) == 1
    assert len({p for _, p in tail}) == 2
    monkeypatch.setattr(r.results, "take", lambda bs, fed: r.results.zeros(r.results.forward_shapes(bs)))
    fresh = _drive(engine, prompts, params)
    assert cycled == fresh


def test_unfetched_results_and_fed_tokens_are_never_donated(built):
    """Steps dispatched back to back before any fetch (as the draft model does) each keep
    their own result buffers; the tokens the next call is fed (`last_tokens`) are never
    donated into it, also in the synchronous loop (dispatch, fetch, dispatch). A donated
    array is deleted, so a wrong reuse shows as a deleted or shared buffer."""
    engine, _ = built
    r = engine.runner
    from serving.sampling import SamplingArrays

    captured = []
    orig = r.dispatch

    def spy(arrays, sampling, feed=None, *, full=True):
        captured.append(arrays)
        return orig(arrays, sampling, feed, full=full)

    r.dispatch = spy
    try:
        rng = np.random.default_rng(1)
        _drive(engine, [rng.integers(3, 200, 6).tolist()], SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        del r.dispatch
    arrays = captured[-1]  # a one-row decode step (slot 0 is not freed state: it is re-run only)
    greedy = SamplingArrays.from_rows([{}] * len(arrays.slot_ids))
    for _ in range(3):  # the free list now holds sets of this row count
        r.fetch(r.dispatch(arrays, greedy, full=False))
    pend = [r.dispatch(arrays, greedy, full=False) for _ in range(4)]
    arrays_of = [p[1:5] for p in pend]
    assert not any(x.is_deleted() for xs in arrays_of for x in xs)
    ptrs = [xs[0].unsafe_buffer_pointer() for xs in arrays_of]
    assert len(set(ptrs)) == len(ptrs)
    for p in pend:
        r.fetch(p)
    for _ in range(4):  # synchronous: the fetched set that holds last_tokens is skipped
        fed = r.last_tokens
        r.fetch(r.dispatch(arrays, greedy, full=False))
        assert not fed.is_deleted()
