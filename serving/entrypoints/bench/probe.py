"""Driving an engine from outside for benchmarks: decode timing and profiler scopes.

`measure_decode` submits a batch, steps until every sequence is past its prefill
(each has its first token), then times steps in which the whole batch decodes: a
step counts only if every request of the batch got exactly one new token from it
and none finished. `decoding_batch` and `whole_batch_steps` do the same for scripts
that time or trace steps their own way. `trace_scopes` names the engine's phases in a jax.profiler trace
by wrapping the engine's methods where they exist (the engine's own code is not
changed). Only the public engine API is relied on: add_request, step, abort, stats.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import jax
import numpy as np

from serving.entrypoints.profiling import trace_scopes  # noqa: F401 - re-exported
from serving.sample.sampling_params import SamplingParams


@dataclass
class DecodeRun:
    batch: int
    prompt_len: int
    prefill_s: float
    step_s: list[float] = field(default_factory=list)
    skipped_steps: int = 0  # steps in which not every sequence decoded (excluded)
    stats: dict = field(default_factory=dict)  # engine.stats() during the decode phase
    outputs: list[int] = field(default_factory=list)  # tokens of each request after the last timed step

    @property
    def num_output_tokens(self) -> int:
        return min(self.outputs)

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    def summary(self) -> dict[str, float | int]:
        med = self.median_s
        return {"batch": self.batch, "context": self.prompt_len, "prefill_s": self.prefill_s,
                "prefill_tok_s": self.batch * self.prompt_len / self.prefill_s,
                "decode_steps_timed": len(self.step_s), "decode_steps_skipped": self.skipped_steps,
                "step_ms_median": 1e3 * med, "step_ms_p90": 1e3 * float(np.percentile(self.step_s, 90)),
                "step_ms_min": 1e3 * min(self.step_s), "decode_tok_s": self.batch / med}


def decode_budget(*, batch: int, prompt_len: int, chunk: int, steps: int, warmup: int) -> int:
    """max_tokens per request for `measure_decode`: chunked prefill staggers the sequences'
    first tokens by up to one per prefill step, and the earliest must not finish before
    the batch has decoded `warmup + steps` steps together (with room for skipped steps)."""
    prefill_steps = -(-batch * prompt_len // chunk) + batch
    return warmup + 2 * steps + 4 + prefill_steps


def measure_decode(engine, *, batch: int, prompt_len: int, steps: int, warmup: int, max_tokens: int,
                   vocab_size: int, rng: np.random.Generator, max_prefill_steps: int = 1_000_000,
                   tracer: StepTracer | None = None, shared_prefix: int = 0) -> DecodeRun:
    """Time `steps` engine steps in which all `batch` sequences decode (after `warmup`).

    shared_prefix > 0 (an engine with prefix caching): every prompt starts with the same
    `shared_prefix` random tokens, followed by its own random tokens. One request of the
    prefix alone is served first (its prefill time is counted), so the batch's prompts
    resume from its cached state and pages and prefill only their own tokens.
    """
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    prefix: list[int] = []
    if shared_prefix:
        if not 0 < shared_prefix < prompt_len:
            raise ValueError(f"shared_prefix={shared_prefix} must be in (0, prompt_len={prompt_len})")
        prefix = rng.integers(3, vocab_size, shared_prefix).tolist()
        warm = engine.add_request(prompt_token_ids=prefix, params=SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True))
        for _ in range(max_prefill_steps):
            if any(d.request_id == warm and d.finished for d in engine.step()):
                break
    ids = [engine.add_request(prompt_token_ids=prefix + rng.integers(
        3, vocab_size, prompt_len - len(prefix)).tolist(), params=params) for _ in range(batch)]
    outputs = dict.fromkeys(ids, 0)
    try:
        for _ in range(max_prefill_steps):  # until every sequence has its first token
            _count(engine.step(), outputs)
            if all(outputs.values()):
                break
        else:
            raise RuntimeError(f"prefill of {batch} x {prompt_len} did not finish "
                               f"in {max_prefill_steps} steps")
        run = DecodeRun(batch, prompt_len, time.perf_counter() - t0)
        _timed_steps(engine, run, outputs, steps=steps, warmup=warmup, tracer=tracer)
        run.stats = engine.stats()
        run.outputs = list(outputs.values())
        if not run.step_s:
            raise RuntimeError(f"no step decoded the whole batch of {batch} (max_num_seqs too small?)")
        return run
    finally:
        for rid in ids:
            engine.abort(rid)


def _timed_steps(engine, run: DecodeRun, outputs: dict[str, int], *, steps: int, warmup: int,
                 tracer: StepTracer | None) -> None:
    """Step past `warmup`, then keep the times of steps where every sequence got one token."""
    done = 0
    while len(run.step_s) < steps and done < warmup + 2 * steps + 2:
        before = dict(outputs)
        if tracer is not None and done == warmup:
            tracer.start()
        t = time.perf_counter()
        deltas = engine.step()
        dt = time.perf_counter() - t
        finished = _count(deltas, outputs)
        done += 1
        if done <= warmup:
            continue
        if not finished and all(outputs[r] - before[r] == 1 for r in outputs):
            run.step_s.append(dt)
        else:
            run.skipped_steps += 1
    if tracer is not None:
        tracer.stop()


def _count(deltas, outputs: dict[str, int]) -> bool:
    """Add each delta's new tokens to `outputs`; True if one of our requests finished."""
    finished = False
    for d in deltas:
        if d.request_id in outputs:
            outputs[d.request_id] += len(d.token_ids)
            finished |= d.finished
    return finished


def time_chained(fn, state, args, reps: int, inner: int):
    """(median seconds per call, last out, last state) of `out, state = fn(state, *args)`,
    each call fed the previous one's state (in-place kernels, donated pools): two warm-up
    calls, then `reps` rounds of `inner` calls, each round waited for once."""
    for _ in range(2):
        out, state = fn(state, *args)
    jax.block_until_ready((out, state))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out, state = fn(state, *args)
        jax.block_until_ready((out, state))
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times), out, state


class StepTracer:
    """Records one jax.profiler trace into `directory` between start() and stop() (once)."""

    def __init__(self, directory: str | None):
        self.directory, self.state = directory, "idle"

    def start(self) -> None:
        if self.directory and self.state == "idle":
            jax.profiler.start_trace(self.directory)
            self.state = "tracing"

    def stop(self) -> None:
        if self.state == "tracing":
            jax.profiler.stop_trace()
            self.state = "done"


@contextlib.contextmanager
def whole_batch_steps(engine, batch: int,
                      watch: Callable[..., None] | None = None) -> Iterator[list[bool]]:
    """Record, per step the runner dispatches, whether all `batch` sequences decode in it
    (wraps `engine.runner.dispatch`; restored on exit). Benchmarks count or trace only
    the steps where this is True. `watch(arrays, sampling)`, if given, sees each step's
    host arrays first (their contexts, or the step itself to replay)."""
    full: list[bool] = []
    orig = engine.runner.dispatch

    def spy(arrays, sampling, *args, **kwargs):
        if watch is not None:
            watch(arrays, sampling)
        full.append(len(arrays.slot_ids) == arrays.num_decodes == batch)
        return orig(arrays, sampling, *args, **kwargs)

    engine.runner.dispatch = spy
    try:
        yield full
    finally:
        engine.runner.dispatch = orig


def step_until_whole_batch(engine, full: list[bool], limit: int = 10_000) -> None:
    """Step (prefill, then decode) until the last dispatched step decoded the whole batch."""
    for _ in range(limit):
        engine.step()
        if full and full[-1]:
            return


@contextlib.contextmanager
def decoding_batch(engine, batch: int, context: int, max_tokens: int,
                   seed: int = 2) -> Iterator[list[bool]]:
    """Serve `batch` random prompts of `context` tokens (greedy, EOS ignored), step until
    the whole batch decodes, and yield `whole_batch_steps`' record (cleared) for the
    steps the caller runs; on exit abort the requests and drain the engine."""
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(prompt_token_ids=rng.integers(3, vocab, context).tolist(), params=params)
           for _ in range(batch)]
    try:
        with whole_batch_steps(engine, batch) as full:
            step_until_whole_batch(engine, full)  # prefill, then until the whole batch decodes
            full.clear()
            yield full
    finally:
        for rid in ids:
            engine.abort(rid)
        while engine.has_unfinished():
            engine.step()
