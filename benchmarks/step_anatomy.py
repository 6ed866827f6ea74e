"""Where a decode step's time goes: engine step, compiled step, host enqueue, GPU kernels, byte floor.

Fills a batch of B sequences with prompts of length P through `LLMEngine`, runs until
every sequence decodes, then measures on steps where the WHOLE batch decodes:

  engine_ms    `LLMEngine.step()` wall time (median; the step returns host tokens);
               engine_mean_ms its mean (the throughput figure: a slow step now and then
               moves the mean, not the median)
  compiled_ms  the compiled decode step alone (forward with the plain sampler), inputs
               already on the device, called back to back (median per call, synchronised loop)
  enqueue_ms   host time for one such call to return (before the device finishes)
  kernel_ms    sum of GPU kernel durations per step in a jax.profiler trace
  kernels      GPU kernels (and memcpys) per step in that trace
  floor_ms     bytes the step must move (weights + in-window K/V + recurrent state
               read and written) over the device-to-device copy bandwidth measured here;
               K/V at each sequence's real context in the measured steps (`context` is
               their mean, with context_min / context_max: sequences admitted early have
               decoded while later ones prefilled, so contexts exceed the prompt length);
               of a mixture of experts, the experts its steps touched, counted from the
               model's own routing over these sequences (`touched_experts`;
               floor_uniform_routing_ms: the floor if routing were uniform)

Prints one table row per configuration; `--out FILE` writes JSON with the top kernels.

  PYTHONPATH=. python benchmarks/step_anatomy.py --batch 64 --prompt-len 600
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

import jax
import numpy as np

from configs import switches
from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine, freeze_heap
from serving.entrypoints.bench.floor import copy_bandwidth, engine_floor_bytes, measured_touched_experts
from serving.entrypoints.bench.probe import step_until_whole_batch, whole_batch_steps
from serving.entrypoints.bench.trace_report import (
    gpu_kernel_events,
    host_event_totals,
    kernel_family,
    trace_calls,
)
from serving.runner.runner import fuse_projections_enabled
from serving.sample.sampling_params import SamplingParams

KERNEL_DETAILS: dict[str, str] = {}  # GEMM kernel name -> its launch details in the trace


def kernel_details(ev) -> str:
    """The profiler's launch details of a kernel event (grid, block, registers, shared
    memory), or all its stats if that one is missing."""
    stats = {str(k): str(v) for k, v in ev.stats}
    return stats.get("kernel_details", json.dumps(stats))


def trace_kernels(fn, n: int, keep: int = 150) -> tuple[float, float, list[tuple[str, float, int]], dict]:
    """Run fn() n times under the profiler: (kernel ms per step, kernels per step, top kernels,
    idle time between them: `idle_gaps`)."""
    fn()
    jax.block_until_ready(fn())
    d = trace_calls(fn, n)
    total, count = 0.0, 0
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    copies: dict[str, list[float]] = collections.defaultdict(list)
    spans: list[tuple[float, float, str]] = []
    for _, ev in gpu_kernel_events(d, memcpy=True):
        spans.append((ev.start_ns, ev.end_ns, ev.name[:80]))
        if "memcpy" in ev.name.lower():
            copies[ev.name[:40]].append(ev.duration_ns)
            continue
        if "nvjet" in ev.name or "gemm" in ev.name:  # launch shape: grid, block, registers
            KERNEL_DETAILS.setdefault(ev.name[:80], kernel_details(ev))
        total += ev.duration_ns
        count += 1
        by_name[ev.name[:80]].append(ev.duration_ns)
    top = sorted(((k, sum(v) / 1e6 / n, len(v) // n) for k, v in by_name.items()), key=lambda r: -r[1])
    gaps = idle_gaps(spans, n)
    # copies (not kernels: left out of the totals above), per step: ms, count
    gaps["copies"] = {k: [round(sum(v) / 1e6 / n, 4), round(len(v) / n, 2)] for k, v in copies.items()}
    return total / 1e6 / n, count / n, (top[:keep] if keep else top), gaps


def idle_gaps(spans: list[tuple[float, float, str]], n: int) -> dict[str, object]:
    """Idle GPU time between consecutive kernels (one stream), per step, charged to the
    kernel (or memcpy) that starts after the gap; gaps over 50 us are counted apart
    (`between_calls_ms`, with the event that ends them in `long_gaps_before`)."""
    spans.sort()
    by_next: dict[str, list[float]] = collections.defaultdict(list)
    long_before: dict[str, list[float]] = collections.defaultdict(list)
    small = big = 0.0
    for (_, end, _), (start, _, name) in zip(spans, spans[1:], strict=False):
        gap = max(0.0, start - end)
        if gap > 50e3:
            big += gap
            long_before[kernel_family(name)].append(gap)
            continue
        small += gap
        by_next[kernel_family(name)].append(gap)
    rows = sorted(((k, sum(v) / 1e6 / n, len(v) / n, sum(v) / len(v) / 1e3) for k, v in by_next.items()),
                  key=lambda r: -r[1])
    # The union of the kernels' spans: below the sum of their durations when kernels of
    # the step run concurrently (several streams, or concurrent branches of its graph).
    busy, reach = 0.0, float("-inf")
    for start, end, _ in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return {"idle_ms_per_step": small / 1e6 / n, "between_calls_ms": big / 1e6 / n,
            "busy_ms_per_step": busy / 1e6 / n,
            "idle_before": [[k, round(ms, 4), cnt, round(us, 2)] for k, ms, cnt, us in rows[:40]],
            "long_gaps_before": {k: [round(sum(v) / 1e6 / n, 3), len(v)] for k, v in long_before.items()}}


def hlo_stats(text: str) -> dict[str, object]:
    """Kernel-launching instructions at the top level of the optimised HLO, and command buffers.

    XLA's command-buffer pass moves runs of capturable thunks into `call`s of computations
    named command_buffer*; what stays at the top level launches one by one from the host.
    """
    import re

    entry = text[text.index("ENTRY"):]
    entry = entry[:entry.index("\n}")]
    ops = collections.Counter()
    for line in entry.splitlines()[1:]:
        m = re.search(r"= [^ ]+ ([a-z-]+)\(", line) or re.search(r"= \([^)]*\) ([a-z-]+)\(", line)
        if m:
            op = m.group(1)
            if op == "custom-call":
                t = re.search(r'custom_call_target="([^"]+)"', line)
                op += ":" + (t.group(1)[:40] if t else "?")
            ops[op] += 1
    bufs = re.findall(r"\n(%?command_buffer[^ ]*) ", text)
    sizes = []
    for name in bufs:
        body = text[text.index(name + " "):]
        body = body[:body.index("\n}")]
        sizes.append(body.count("\n  "))
    launching = {k: v for k, v in ops.items() if k not in (
        "parameter", "get-tuple-element", "tuple", "bitcast", "constant", "copy-start", "copy-done")}
    return {"entry_ops": dict(ops.most_common()), "launching_top_level": sum(launching.values()),
            "command_buffers": len(bufs), "command_buffer_sizes": sizes}


def timed(obj, name: str, acc: dict[str, float]) -> None:
    """Replace obj.name by a wrapper adding its wall time (s) to acc[name]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[name] = acc.get(name, 0.0) + time.perf_counter() - t

    wrapper.__wrapped__ = fn
    setattr(obj, name, wrapper)


def run(a: argparse.Namespace) -> dict:
    lm = load_model(a.model, dtype=a.dtype)
    # Early sequences decode while later ones prefill: enough tokens that none finishes first.
    extra = 264 + 2 * -(-a.batch * a.prompt_len // max(a.chunk, a.batch))
    rows = max(a.batch, a.seq_bucket)
    cfg = EngineConfig(max_num_seqs=rows, max_num_batched_tokens=max(a.chunk, rows),
                       compile_in_background=False,  # all executables built before timing
                       max_prefill_chunk=a.chunk, max_model_len=a.prompt_len + a.steps + extra,
                       page_size=16, dtype=a.dtype, memory_fraction=0.85, quantization=a.quantization,
                       kv_cache_dtype=a.kv_cache_dtype, seq_buckets=(rows,),
                       token_buckets=(max(a.chunk, rows),),
                       async_scheduling=not a.sync,
                       **({"ssm_state_dtype": a.state_dtype} if a.state_dtype else {}))
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    freeze_heap()  # as `serve` does: one engine for the process's life
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=a.steps + extra - 32, ignore_eos=True)
    for _ in range(a.batch):
        engine.add_request(prompt_token_ids=rng.integers(3, lm.config.vocab_size, a.prompt_len).tolist(),
                           params=params)
    started: set[str] = set()
    while len(started) < a.batch:  # prefill until every sequence has its first token
        started |= {d.request_id for d in engine.step()}
    step_s, lengths = [], []
    captured = {}

    def watch(arrays, sampling):
        captured["args"] = (arrays, sampling)
        lengths.append(arrays.seq_lens.copy())

    with whole_batch_steps(engine, a.batch, watch) as ran:
        step_until_whole_batch(engine, ran, limit=200)  # late prefills and recomputes done
        ran.clear()
        lengths.clear()
        # Host time per measured step by part: schedule (scheduler), _dispatch (flatten, sampling
        # rows, padding, transfers, enqueue; includes dispatch = the runner's part), fetch
        # (waiting for the previous step's tokens), update (scheduler), _delta (detokenize, stops).
        host: dict[str, float] = {}
        undo = [(engine.scheduler, "schedule"), (engine.scheduler, "update"), (engine, "_dispatch"),
                (engine, "_delta"), (engine.runner, "fetch"), (engine.runner, "dispatch")]
        for obj, name in undo:
            timed(obj, name, host)
        # Inside the runner's dispatch: host-to-device transfers, and enqueueing the forward
        # and the sampler executables.
        timed(jax, "device_put", host)
        timed(engine.runner, "_host_put", host)  # the step's packed inputs (serving/host_pack.host_put)
        executables = (engine.runner.compiled, engine.runner.samplers)
        saved = [dict(d) for d in executables]
        for d, kind in zip(executables, ("enqueue_forward", "enqueue_sampler"), strict=True):
            for key, fn in list(d.items()):
                def wrapped(*args, _fn=fn, _kind=kind):
                    t = time.perf_counter()
                    try:
                        return _fn(*args)
                    finally:
                        host[_kind] = host.get(_kind, 0.0) + time.perf_counter() - t
                d[key] = wrapped
        for _ in range(a.steps):
            t = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - t)
        for obj, name in undo:
            obj.__dict__.pop(name, None)
        engine.runner._host_put = engine.runner._host_put.__wrapped__
        jax.device_put = jax.device_put.__wrapped__
        for d, orig_d in zip(executables, saved, strict=True):
            d.update(orig_d)
    measured_lengths = list(lengths)
    assert all(ran), f"a measured step was not a full-batch decode: {ran} {engine.stats()}"
    engine_gaps = None
    host_events = None
    if a.trace_host:  # where the host's time goes inside engine.step() (TraceMe scopes)
        host_events = host_event_totals(trace_calls(engine.step, 10), 10, 40)
        for thread, name, ms, calls in host_events:
            print(f"  host {ms:8.3f} ms/step x{calls:<6} {thread:<28} {name}")
    if a.trace_engine:  # the engine loop's own GPU timeline (idle between kernels and steps)
        loop_ms, loop_kernels, loop_top, engine_gaps = trace_kernels(engine.step, 10, 0)
        # The loop's own kernels per step (its GPU work can exceed the compiled step's: other
        # executables, copies of buffers the step could not take in place)
        engine_gaps = {**engine_gaps, "kernel_ms": loop_ms, "kernels_per_step": loop_kernels,
                       "top_kernels": [[k, round(ms, 4), c] for k, ms, c in loop_top[:40]]}
        print("engine loop gaps:", json.dumps(engine_gaps)[:2000])
        for name, ms, calls in loop_top[:15]:
            print(f"  loop {ms:8.3f} ms/step x{calls:<5} {name}")
        print(f"  loop kernels {loop_ms:.3f} ms/step; copies (ms/step, count/step): {engine_gaps['copies']}")
    # The compiled decode executable alone, every input on the device.
    r = engine.runner
    arrays, sampling = captured["args"]
    bucket = r.pick(arrays)
    exe = r.compiled[bucket]
    from serving.core.schedule import PENDING
    from serving.runner.padding import pad_rows
    from serving.sample.sampling import SamplingArrays

    samp = SamplingArrays(*(pad_rows(np.asarray(x), bucket.seqs) for x in sampling))
    padded = r._pad(arrays, bucket)
    # The decode rows' tokens are PENDING on the host (the loop feeds them from the last
    # step's samples on the device): feed them here too, row i from row i of the previous
    # call's samples, as the loop does for the same batch. Without it every row embedded
    # the same placeholder and a MoE model's rows chose the same few experts (a compiled
    # step under its floor).
    toks = np.asarray(padded.tokens)
    feed = np.where(toks == PENDING, np.arange(len(toks)), -1).astype(np.int32)
    tree = r._host_tree(bucket, padded, samp, feed, None)
    buf = jax.device_put(r.host_layouts[bucket].pack(tree))
    logits, plain = r.results.take(bucket.seqs, r.last_tokens)
    # Two sets of sample buffers, alternating, as the engine's loop cycles them
    # (serving/runner/result_buffers.py).
    sets = [plain, r.results.zeros(r.results.forward_shapes(bucket.seqs)[1])]
    state = {"caches": r.caches, "stats": r.stats, "last": r.last_tokens, "logits": logits, "k": 0}

    def call():  # one executable: the plain sampler runs inside the forward
        k = state["k"]
        state["caches"], state["stats"], state["logits"], out = exe(
            r.params, state["caches"], state["stats"], buf, state["last"], (state["logits"], sets[k]))
        sets[k], state["k"], state["last"] = out, 1 - k, out[0]
        return out

    jax.block_until_ready(call())
    enq, per = [], []
    for _ in range(5):
        jax.block_until_ready(call())
        t = time.perf_counter()
        out = call()
        enq.append(time.perf_counter() - t)
        jax.block_until_ready(out)
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            out = call()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t) / 10)
    text = exe.as_text()
    hlo = hlo_stats(text)
    if a.dump:
        with open(a.dump, "w") as f:
            f.write(text)
    print("hlo:", json.dumps(hlo))
    kernel_ms, kernels, top, gaps = trace_kernels(call, 10, a.top)
    r.caches, r.stats, r.last_tokens = state["caches"], state["stats"], state["last"]
    r.results.keep_logits(bucket.seqs, state["logits"])
    bw = copy_bandwidth()
    # The measured steps' real contexts (the floor of their mean step), not the prompt length.
    ctx = np.stack(measured_lengths)  # [steps, b]
    # A mixture of experts: the experts its steps touched, from the model's own routing
    # over these sequences (a random-weight router can be far from uniform: floor.py).
    touched, routing_check = None, None
    if lm.config.moe is not None and any(s.moe for s in lm.config.layers):
        seqs = [seq.token_ids for seq in engine.scheduler.running]
        routing_check = {}
        touched = measured_touched_experts(lm.model, seqs, a.steps, check=routing_check)
        print(f"touched experts per layer (model forward): {touched:.2f}; {routing_check}")
    uniform = [engine_floor_bytes(engine, x) for x in ctx]
    per_step = [engine_floor_bytes(engine, x, touched) for x in ctx]
    fb = {k: sum(f[k] for f in per_step) // len(per_step) for k in per_step[0]}
    fb_uniform = sum(f["total"] for f in uniform) // len(uniform)
    context = round(float(ctx.mean()), 1)
    res = {
        "model": a.model, "dtype": a.dtype, "state_dtype": a.state_dtype or "float32",
        "quantization": a.quantization, "kv_cache_dtype": engine.stats()["kv_cache_dtype"],
        "weight_bytes_by_dtype": engine.stats()["weight_bytes_by_dtype"],
        "loop": "sync" if a.sync else "async",
        "batch_run": a.batch, "context": context, "context_min": int(ctx.min()),
        "context_max": int(ctx.max()), "device": str(jax.devices()[0]),
        "startup_s": round(startup, 1), "engine_ms": 1e3 * statistics.median(step_s),
        "engine_mean_ms": 1e3 * statistics.fmean(step_s),
        "compiled_ms": 1e3 * statistics.median(per), "enqueue_ms": 1e3 * statistics.median(enq),
        "kernel_ms": kernel_ms, "kernels_per_step": kernels, "copy_TBps": bw / 1e12,
        "floor_bytes": fb, "floor_ms": 1e3 * fb["total"] / bw, "top_kernels": top,
        "touched_experts": touched, "routing_check": routing_check,
        "floor_uniform_routing_ms": 1e3 * fb_uniform / bw,
        "gemm_kernel_details": dict(KERNEL_DETAILS),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_options": switches.xla_options(), "hlo": hlo,
        "host_ms_per_step": {k: 1e3 * v / a.steps for k, v in host.items()},
        "gaps": gaps, "engine_gaps": engine_gaps,
        "fuse_projections": fuse_projections_enabled(), "host_events": host_events,
    }
    res["engine_over_floor"] = res["engine_ms"] / res["floor_ms"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--state-dtype", default=None, help="ssm_state_dtype (engine default if unset)")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="EngineConfig.quantization (fp8: FP8 decoder weights; benchmarks/fp8.py)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="EngineConfig.kv_cache_dtype (fp8: e4m3 K/V pages; the floor counts their bytes)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq-bucket", type=int, default=0,
                   help="run the batch in a decode bucket of this many rows (padded; default: the batch)")
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--sync", action="store_true", help="async_scheduling=False (the synchronous loop)")
    p.add_argument("--dump", default=None, help="write the decode executable's optimised HLO here")
    p.add_argument("--trace-host", action="store_true",
                   help="trace 10 engine steps and print the host's TraceMe scopes by time")
    p.add_argument("--trace-engine", action="store_true",
                   help="also trace 10 LLMEngine.step() calls: idle GPU time within and between steps")
    p.add_argument("--top", type=int, default=150, help="kernels kept in the JSON, by time (0: all)")
    a = p.parse_args()
    res = run(a)
    cols = ["batch_run", "context", "state_dtype", "loop", "engine_ms", "engine_mean_ms", "compiled_ms",
            "enqueue_ms",
            "kernel_ms", "kernels_per_step", "floor_ms", "engine_over_floor", "startup_s"]
    print(" | ".join(cols))
    print(" | ".join(f"{res[c]:.2f}" if isinstance(res[c], float) else str(res[c]) for c in cols))
    print("host ms per step:", " ".join(f"{k}={v:.2f}" for k, v in res["host_ms_per_step"].items()))
    for name, ms, n in res["top_kernels"][:25]:
        print(f"  {ms:8.3f} ms  x{n:<4d} {name}")
    g = res["gaps"]
    print(f"idle between kernels: {g['idle_ms_per_step']:.3f} ms/step; "
          "before (kernel family, ms, per step, mean us):")
    for name, ms, cnt, us in g["idle_before"][:15]:
        print(f"  {ms:8.3f} ms  x{cnt:<6.1f} {us:6.2f} us  {name}")
    print(f"gaps over 50 us: {g['between_calls_ms']:.3f} ms/step, before: {g['long_gaps_before']}")
    print(f"GPU busy (union of kernel spans): {g['busy_ms_per_step']:.3f} ms/step "
          f"(kernel time {res['kernel_ms']:.3f}: concurrency hides the difference)")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
