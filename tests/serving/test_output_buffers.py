"""The executables write their results into donated buffers that the runner cycles
(serving/runner/result_buffers.py): every executable aliases them (the forward here; multi-step
and verification in test_multi_step and test_speculative), and the
buffers are reused across steps without ever handing a result still to be read, or the
next step's fed tokens, to a new call. Outputs themselves are checked against the
synchronous loop and the full forward elsewhere (test_overlap, test_engine_parity);
here the decoding through the cycled buffers is checked against the same engine given
fresh buffers each call."""

from __future__ import annotations

import itertools

import jax
import numpy as np

from serving.sample.sampling_params import SamplingParams

_IDS = itertools.count()


def assert_results_aliased(exe, *donated) -> None:
    """Every leaf of `donated` (the caches, statistics, checkpoints and result buffers the
    executable takes donated) is aliased to one of its outputs: XLA writes the results
    into the donated buffers. A result buffer whose shape or dtype matched no output would
    be wasted, and the result allocated afresh each call (with temporaries in it)."""
    header = exe.as_text().split("\n", 1)[0]
    assert header.count("alias)") == len(jax.tree.leaves(donated)), header[:400]


def test_forward_executables_alias_their_results(server_engine):
    r = server_engine.runner
    assert r.compiled
    for bucket, exe in r.compiled.items():
        assert_results_aliased(exe, r.caches, r.stats, r.results.forward_shapes(bucket.seqs))


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


def test_unfetched_results_and_fed_tokens_are_never_donated(server_engine):
    """Steps dispatched back to back before any fetch (as the draft model does) each keep
    their own result buffers; the tokens the next call is fed (`last_tokens`) are never
    donated into it, also in the synchronous loop (dispatch, fetch, dispatch). A donated
    array is deleted, so a wrong reuse shows as a deleted or shared buffer."""
    engine = server_engine
    r = engine.runner
    from serving.sample.sampling import SamplingArrays

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


def test_result_buffers_bounds_and_skips():
    """`ResultBuffers` on its own: logits buffers kept for the most recent row counts only,
    at most FREE_SETS sample sets per row count, a set holding the fed tokens or a deleted
    (donated) array never handed out."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from serving.runner.result_buffers import FREE_SETS, LOGITS_KEPT, ResultBuffers
    from serving.runner.step_fns import TOP_LOGPROBS

    rep = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("x",)), PartitionSpec())
    rb = ResultBuffers(vocab_size=11, max_seqs=8, sharding=rep)
    for b in range(1, LOGITS_KEPT + 3):
        logits, _ = rb.take(b, fed=None)
        assert logits.shape == (b, 11)
        rb.keep_logits(b, logits)
    assert list(rb._logits) == list(range(3, LOGITS_KEPT + 3))
    kept = rb._logits[LOGITS_KEPT + 2]
    assert rb.take(LOGITS_KEPT + 2, fed=None)[0] is kept
    sets = [rb.zeros(rb.forward_shapes(4)[1]) for _ in range(FREE_SETS + 2)]
    for s in sets:
        rb.recycle(4, s)
    assert len(rb._free[4]) == FREE_SETS
    fed = sets[0][0]
    _, got = rb.take(4, fed=fed)
    assert got is sets[1]  # sets[0] holds the fed tokens: skipped
    sets[2][1].delete()
    _, got = rb.take(4, fed=fed)
    assert got is not sets[2] and got is not sets[0]
    assert got[0].shape == (8,) and got[2].shape == (4, TOP_LOGPROBS)
