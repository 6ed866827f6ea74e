"""A load generator for `hybrid-jax serve` (gRPC here; the OpenAI HTTP API in `openai_load`),
in the manner of vLLM's benchmark_serving.

Requests leave at Poisson arrivals of a given rate (or all at once with rate inf),
with at most `concurrency` in flight; each streams its tokens back and is timed on
the client: TTFT (send -> first token), TPOT ((last - first token) / (tokens - 1),
the first token excluded), ITL (gaps between token-bearing messages) and E2E (send ->
stream end). The loop is bounded in count (the request list) and in time (no request
is sent after `duration_s`; each has a deadline of `timeout_s`). Failures are
counted by status code. `drive` is the arrival loop that both transports share. This
module imports no JAX and knows nothing of the engine: it only speaks the proto.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from serving.entrypoints.grpc.client import make_request
from serving.proto.hybrid_jax.v1 import generation_pb2_grpc as pb_grpc

MAX_THREADS = 1024  # client threads (one per request in flight); beyond, requests queue here


@dataclass
class Record:
    """One request as the client saw it (times are time.perf_counter seconds)."""

    prompt_len: int
    max_tokens: int
    sent: float = 0.0
    token_times: list[float] = field(default_factory=list)  # one per token-bearing message
    output_tokens: int = 0
    end: float = 0.0
    code: str = "OK"

    @property
    def ok(self) -> bool:
        return self.code == "OK"


@dataclass(frozen=True)
class LoadSpec:
    rate: float = math.inf  # requests/s (Poisson); inf: all at once
    concurrency: int | None = None  # most requests in flight; None: unbounded
    duration_s: float = 600.0  # no request is sent after this
    timeout_s: float = 600.0  # deadline of each request
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate={self.rate} must be > 0 (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency={self.concurrency} must be >= 1")
        for name in ("duration_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from start) of n requests: Poisson process of `rate`, or all 0."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


def run_load(target: str, prompts: list[list[int]], max_tokens: list[int], spec: LoadSpec,
             sampling: dict | None = None) -> tuple[list[Record], float]:
    """Send the requests to `target` over gRPC; returns the records of those SENT and the wall time."""
    channel = grpc.insecure_channel(target)
    stub = pb_grpc.GenerationStub(channel)

    def send(prompt: list[int], n: int, rec: Record) -> None:
        request = make_request(prompt, max_tokens=n, ignore_eos=True, **(sampling or {}))
        try:
            for msg in stub.Generate(request, timeout=spec.timeout_s):
                if msg.token_ids:
                    rec.token_times.append(time.perf_counter())
                    rec.output_tokens += len(msg.token_ids)
        except grpc.RpcError as err:
            rec.code = err.code().name

    try:
        return drive(send, prompts, max_tokens, spec)
    finally:
        channel.close()


def drive(send: Callable[[list[int], int, Record], None], prompts: list[list[int]], max_tokens: list[int],
          spec: LoadSpec) -> tuple[list[Record], float]:
    """The arrival loop of any transport: `send(prompt, max_tokens, record)` runs one request to
    its end in a client thread, filling the record (a failure sets `record.code`)."""
    if len(prompts) != len(max_tokens):
        raise ValueError(f"max_tokens: {len(max_tokens)} lengths for {len(prompts)} prompts")
    offsets = arrival_offsets(len(prompts), spec.rate, np.random.default_rng(spec.seed))
    slots = threading.BoundedSemaphore(spec.concurrency or len(prompts) or 1)
    records: list[Record] = []
    workers = min(len(prompts), spec.concurrency or len(prompts), MAX_THREADS) or 1
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="load") as pool:
        for prompt, n, at in zip(prompts, max_tokens, offsets, strict=True):
            if at > spec.duration_s:
                break
            time.sleep(max(0.0, start + at - time.perf_counter()))
            if not slots.acquire(timeout=max(0.0, start + spec.duration_s - time.perf_counter())):
                break
            rec = Record(len(prompt), n)
            records.append(rec)
            pool.submit(_one, send, prompt, n, rec, slots)
    return records, time.perf_counter() - start


def _one(send, prompt: list[int], n: int, rec: Record, slots: threading.BoundedSemaphore) -> None:
    rec.sent = time.perf_counter()
    try:
        send(prompt, n, rec)
    except Exception as err:  # a client-side bug must still count as a failure, not vanish
        rec.code = f"CLIENT_{type(err).__name__}"
    finally:
        rec.end = time.perf_counter()
        slots.release()


def report(records: list[Record], wall_s: float) -> dict:
    """Latency summaries (ms), throughput and failures by status code, over the records."""
    from serving.entrypoints.bench.common import summarize

    ok = [r for r in records if r.ok]
    ttft = [r.token_times[0] - r.sent for r in ok if r.token_times]
    # Over the arrivals seen: an OpenAI stream may carry several tokens, or none with text, per chunk.
    tpot = [(r.token_times[-1] - r.token_times[0]) / (r.output_tokens - 1)
            for r in ok if r.output_tokens > 1 and len(r.token_times) > 1]
    itl = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    e2e = [r.end - r.sent for r in ok]
    out_tokens = sum(r.output_tokens for r in ok)
    span = (max(r.end for r in records) - min(r.sent for r in records)) if records else wall_s
    return {
        "sent": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "peak_output_tok_s": peak_output_tok_s(ok),
        "failures_by_code": dict(Counter(r.code for r in records if not r.ok)),
        "duration_s": span, "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "request_throughput": len(ok) / span if span > 0 else 0.0,
        "output_tok_s": out_tokens / span if span > 0 else 0.0,
        "total_tok_s": (out_tokens + sum(r.prompt_len for r in ok)) / span if span > 0 else 0.0,
        "ttft_ms": summarize(ttft, 1e3), "tpot_ms": summarize(tpot, 1e3),
        "itl_ms": summarize(itl, 1e3), "e2e_ms": summarize(e2e, 1e3),
    }


def peak_output_tok_s(records: list[Record], window_s: float = 1.0) -> float:
    """The most output tokens that arrived in one window of `window_s` seconds (windows
    from the first send, as vLLM's peak output throughput), divided by it. A message that
    carries several tokens (an OpenAI stream chunk) counts them all at its arrival."""
    if not records:
        return 0.0
    t0 = min(r.sent for r in records)
    bins: Counter = Counter()
    for r in records:
        if not r.token_times:
            continue
        each = r.output_tokens / len(r.token_times)  # tokens per message (1 on gRPC)
        for t in r.token_times:
            bins[int((t - t0) // window_s)] += each
    return max(bins.values(), default=0.0) / window_s
