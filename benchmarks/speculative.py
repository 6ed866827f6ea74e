"""Speculative decoding: decode tok/s and TPOT with and without it, at batch 1, 8 and 64.

Workload: prompts cut from this repository's Python source (code that quotes its own
identifiers: where prompt lookup finds its drafts), greedy, ignore_eos. Only steps
where the whole batch decodes are measured: the window opens when every sequence has
its first token and closes before the step in which the first one finishes. Reported
per batch size and mode: decode tokens/s (all sequences), TPOT (window time / tokens
per sequence), acceptance rate and mean accepted length (tokens per verified
sequence-step: accepted drafts + 1), and the speed-up over speculation off.

  # n-gram on the shipped code model (trained on Python, docs/training.md), H100 ~2 min:
  PYTHONPATH=. python benchmarks/speculative.py --method ngram
  # draft model: native-1b-parallel drafted by native-1b-draft (random weights: the
  # acceptance is ~0, so this measures the drafting + verification overhead):
  PYTHONPATH=. python benchmarks/speculative.py --method draft --model native-1b-parallel \
      --draft-model native-1b-draft --dtype bfloat16
  # draft model, acceptance ~1 (the model drafts for itself: the mechanics' upper bound):
  PYTHONPATH=. python benchmarks/speculative.py --method draft --draft-model default
  PYTHONPATH=. python benchmarks/speculative.py --smoke   # CPU toy run

Speculation is forced on at every batch size here (speculative_disable_by_batch_size
None) so that the large-batch slowdown is measured; the engine's default (16) turns
it off above 16 running sequences. Prints one JSON line per (batch, mode).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams

SOURCES = sorted(Path(__file__).resolve().parent.parent.glob("serving/*.py"))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="ngram", choices=["ngram", "draft"])
    p.add_argument("--model", default="default")
    p.add_argument("--draft-model", default="native-py-5m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--smoke", action="store_true", help="CPU toy run (native-tiny, short)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--repeats", type=int, default=3,
                   help="batches served per engine (the row is the median run; all rates in "
                        "decode_tok_s_runs): single windows of a host-bound loop vary run to run")
    p.add_argument("--profile", type=int, default=0,
                   help="trace N whole-batch steps (before the measured window) under jax.profiler: "
                        "GPU kernel ms and kernels per step, top kernels")
    a = p.parse_args()
    if a.smoke:
        a.model, a.draft_model, a.batches = "native-tiny", "native-tiny", "1,4"
        a.prompt_len, a.output_len = 48, 60 if a.profile else 12
    return a


def prompts(lm, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens cut from the repository's source (bytes if no tokenizer)."""
    text = "\n".join(p.read_text() for p in SOURCES)
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start = int(rng.integers(0, len(text) - 8 * length))
        piece = text[start:start + 8 * length]
        ids = lm.tokenizer.encode(piece, add_bos=True) if lm.tokenizer is not None else list(piece.encode())
        ids = [t % lm.config.vocab_size for t in ids][:length]
        out.append(ids)
    return out


def measure(a: argparse.Namespace, lm, b: int, spec: bool) -> dict[str, object]:
    max_len = a.prompt_len + a.output_len + 16
    chunk = min(512, a.prompt_len)
    kw = dict(speculative_method=a.method, num_speculative_tokens=a.k,
              speculative_disable_by_batch_size=None,
              speculative_model=a.draft_model if a.method == "draft" else None) if spec else {}
    cfg = EngineConfig(max_num_seqs=b, max_num_batched_tokens=max(chunk, b), max_prefill_chunk=chunk,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=max_len, dtype=a.dtype, memory_fraction=a.memory_fraction,
                       seq_buckets=(b,), token_buckets=(max(chunk, b),), **kw)
    t0 = time.perf_counter()
    eng = LLMEngine(lm, cfg, show_progress=False)
    startup = time.perf_counter() - t0
    runs = [_window(a, lm, eng, b, spec, profile=a.profile if r == 0 else 0) for r in range(a.repeats)]
    rates = sorted(r["decode_tok_s"] for r in runs)
    row = min(runs, key=lambda r: abs(r["decode_tok_s"] - statistics.median(rates)))  # the median run
    row |= {"startup_s": startup, "repeats": a.repeats, "decode_tok_s_runs": rates}
    if "trace" in runs[0]:  # --profile traces the first run only
        row["trace"] = runs[0]["trace"]
    if spec and a.method == "draft":
        row["draft_model"] = a.draft_model
    del eng
    gc.collect()
    return row


def _window(a: argparse.Namespace, lm, eng: LLMEngine, b: int, spec: bool, profile: int) -> dict[str, object]:
    """Serve one batch of the prompts; figures over the steps where the whole batch decodes."""
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    gc.collect()
    rids = [eng.add_request(prompt_token_ids=p, params=params) for p in prompts(lm, b, a.prompt_len)]
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    t_open = None
    window_tokens, steps = 0, 0
    before = {}
    traced: dict[str, object] = {}
    while eng.has_unfinished():
        deltas = eng.step()
        te = time.perf_counter()
        for d in deltas:
            tokens[d.request_id] += d.token_ids
        if any(d.finished for d in deltas):
            break  # the batch is no longer full: the window closed before this step
        if t_open is None:
            every = all(tokens.values())  # every sequence has its first token
            if every and profile and not traced:
                traced = _profile(eng, profile, tokens)
                continue
            if every:
                t_open = te  # every sequence has its first token: decoding from here
                before = eng.stats()
            continue
        window_tokens += sum(len(d.token_ids) for d in deltas)
        steps += 1
        t_close = te
    if t_open is None or not steps:
        raise SystemExit(f"batch {b}: no step decoded the whole batch (raise --output-len)")
    dt = t_close - t_open
    s = eng.stats()
    row = {"method": a.method if spec else "off", "model": a.model, "batch": b, "k": a.k if spec else 0,
           "decode_tok_s": window_tokens / dt, "tpot_ms": 1e3 * dt / (window_tokens / b),
           "steps": steps, "tokens": window_tokens}
    while eng.has_unfinished():  # finish the batch: the next window starts from an idle engine
        for d in eng.step():
            tokens[d.request_id] += d.token_ids
    row["outputs"] = [tokens[rid] for rid in rids]  # greedy: speculation must not change them
    if spec:  # window figures: differences of the cumulative counters
        d = {k: s[k] - before[k] for k in ("spec_proposed_tokens", "spec_accepted_tokens",
                                           "spec_verify_steps", "spec_plain_steps",
                                           "spec_draft_time_s", "spec_verify_time_s")}
        row |= {"acceptance_rate": d["spec_accepted_tokens"] / d["spec_proposed_tokens"]
                if d["spec_proposed_tokens"] else 0.0,
                "mean_accepted_length": s["spec_mean_accepted_length"],
                "acceptance_per_position": s["spec_acceptance_per_position"],
                "verify_steps": d["spec_verify_steps"], "plain_steps": d["spec_plain_steps"],
                "draft_time_s": d["spec_draft_time_s"], "verify_time_s": d["spec_verify_time_s"]}
    if traced:
        row["trace"] = traced
    return row


def _profile(eng: LLMEngine, n: int, tokens: dict[str, list[int]]) -> dict[str, object]:
    """Trace n engine steps: wall ms per step, GPU kernel ms and kernels per step, top kernels.
    The steps' tokens are added to `tokens` (the outputs compared with speculation off)."""
    from benchmarks.step_anatomy import trace_kernels

    def step():
        deltas = eng.step()
        for d in deltas:
            tokens[d.request_id] += d.token_ids
        return deltas

    verify0 = eng.stats().get("spec_verify_steps", 0)
    t0 = time.perf_counter()
    kernel_ms, kernels, top, _ = trace_kernels(step, n)
    wall = (time.perf_counter() - t0) / (n + 2)  # trace_kernels runs two warm-up steps
    return {"steps": n, "wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": kernel_ms,
            "kernels_per_step": kernels,
            "verify_steps": eng.stats().get("spec_verify_steps", 0) - verify0,
            "top": [(k, round(ms, 4), c) for k, ms, c in top[:25]]}


def main() -> None:
    a = parse()
    lm = load_model(a.model, dtype=a.dtype)
    for b in (int(x) for x in a.batches.split(",")):
        off = measure(a, lm, b, spec=False)
        on = measure(a, lm, b, spec=True)
        on["speedup"] = on["decode_tok_s"] / off["decode_tok_s"]
        same = [x == y for x, y in zip(off.pop("outputs"), on.pop("outputs"), strict=True)]
        on["outputs_equal_off"] = f"{sum(same)}/{len(same)}"  # greedy outputs, request by request
        for row in (off, on):
            line = json.dumps(row)
            print(line, flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(line + "\n")


if __name__ == "__main__":
    main()
