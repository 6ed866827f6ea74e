"""A step's sampling arrays (serving/sample/sampling_rows.py) equal the per-row dict build
(`SamplingArrays.from_rows`, the reference), step after step, while the kept columns
are reused and when the batch changes: rows reordered, a row gone, a row new, and EOS
suppression that ends when a row reaches min_tokens."""

from __future__ import annotations

import numpy as np

from serving.core.sequence import Sequence
from serving.sample.sampling import SamplingArrays
from serving.sample.sampling_params import SamplingParams
from serving.sample.sampling_rows import Request, SamplingRows, constant_row, needs_full

VOCAB = 300


def _request(rid: str, params: SamplingParams, seed: int, prompt_len: int) -> Request:
    seq = Sequence(rid, list(range(3, 3 + prompt_len)), params)
    ban = [2, *params.stop_token_ids]
    return Request(seq, None, ban, needs_full(params), constant_row(params, seed, prompt_len, VOCAB))


def _reference(reqs: list[Request], steps: list[int]) -> SamplingArrays:
    rows = []
    for r, step in zip(reqs, steps, strict=True):
        p = r.seq.params
        rows.append(dict(temperature=p.temperature, top_k=min(max(p.top_k, 0), VOCAB), top_p=p.top_p,
                         min_p=p.min_p, seed=r.row[4], step=step, repetition=p.repetition_penalty,
                         presence=p.presence_penalty, frequency=p.frequency_penalty,
                         prompt_len=r.seq.num_prompt_tokens, want_top=bool(p.logprobs),
                         suppress=r.ban if step < p.min_tokens else ()))
    return SamplingArrays.from_rows(rows)


def _same(a: SamplingArrays, b: SamplingArrays) -> None:
    for name, x, y in zip(SamplingArrays._fields, a, b, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and np.array_equal(x, y), (name, x, y)


def test_rows_equal_the_per_row_build_as_the_batch_changes():
    reqs = {
        "a": _request("a", SamplingParams(temperature=0.0, max_tokens=20), 11, 4),
        "b": _request("b", SamplingParams(temperature=0.8, top_p=0.9, top_k=5000, seed=3,
                                          min_tokens=3, max_tokens=20, stop_token_ids=[7]), 3, 6),
        "c": _request("c", SamplingParams(temperature=1.2, min_p=0.1, repetition_penalty=1.3,
                                          presence_penalty=0.5, logprobs=2, max_tokens=20), 2**32 - 1, 2),
        "d": _request("d", SamplingParams(temperature=0.5, frequency_penalty=-0.4, min_tokens=1,
                                          max_tokens=20), 5, 9),
    }
    rows = SamplingRows()
    batches = [("a", "b", "c"), ("a", "b", "c"), ("a", "b", "c"), ("b", "a", "c"), ("b", "c"),
               ("b", "c", "d"), ("b", "c", "d"), ()]
    outs = {k: 0 for k in reqs}
    for batch in batches:
        seqs = tuple(reqs[k].seq for k in batch)
        step = np.array([outs[k] for k in batch], np.int32)
        got, full = rows.arrays(seqs, reqs, step)
        _same(got, _reference([reqs[k] for k in batch], step.tolist()))
        assert full == any(reqs[k].full for k in batch)
        for k in batch:
            outs[k] += 1
    # "b" ran 7 steps, suppressed in its first 3 (min_tokens); "d" 2, suppressed in its first.
    assert outs["b"] == 7 and outs["d"] == 2


def test_columns_are_kept_while_the_batch_is_unchanged():
    """The same sequences in the same order reuse the columns (the runner's padding
    copies them: serving/runner/padding.py `pad_rows`); the per-step fields are new."""
    req = _request("a", SamplingParams(temperature=0.7, max_tokens=5), 1, 3)
    rows = SamplingRows()
    first, _ = rows.arrays((req.seq,), {"a": req}, np.zeros(1, np.int32))
    second, _ = rows.arrays((req.seq,), {"a": req}, np.ones(1, np.int32))
    assert first.temperature is second.temperature and first.step is not second.step
    _same(second, _reference([req], [1]))
    other = _request("a", SamplingParams(temperature=0.2, max_tokens=5), 1, 3)  # same id, new request
    third, _ = rows.arrays((other.seq,), {"a": other}, np.ones(1, np.int32))
    _same(third, _reference([other], [1]))
