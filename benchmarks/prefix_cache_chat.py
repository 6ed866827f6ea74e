"""Prefix caching on a multi-turn chat workload: TTFT, throughput, hit rate, checkpoint memory.

Several conversations run concurrently (closed loop: a conversation sends its next turn
as soon as the previous answer is complete). Every turn's prompt is the shared system
prompt, the whole history (user messages and the model's own answers) and a new user
message, as a chat front end re-sends it. The same workload runs with caching off and
on (two engines, built one after the other); greedy, random weights, ignore_eos.

  PYTHONPATH=. python benchmarks/prefix_cache_chat.py                  # H100, ~3 min
  PYTHONPATH=. python benchmarks/prefix_cache_chat.py --smoke          # CPU, toy sizes

Prints one line per mode and the speed-up; --out writes JSON (default
prefix_cache_chat.json).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import jax
import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-len", type=int, default=2048)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--chunk", type=int, default=512, help="max_prefill_chunk = tokens per step")
    p.add_argument("--stride", type=int, default=256, help="prefix_state_stride")
    p.add_argument("--checkpoints", type=int, default=64, help="prefix_state_checkpoints")
    p.add_argument("--memory-fraction", type=float, default=0.4)
    p.add_argument("--modes", default="off,on", help="comma-separated: off, on")
    p.add_argument("--smoke", action="store_true", help="CPU toy run (native-tiny, f32, small sizes)")
    p.add_argument("--out", default="prefix_cache_chat.json")
    a = p.parse_args()
    if a.smoke:
        a.model, a.dtype, a.conversations, a.turns = "native-tiny", "float32", 3, 3
        a.system_len, a.user_len, a.output_len, a.chunk, a.stride, a.checkpoints = 64, 8, 6, 32, 32, 16
    return a


def run(a: argparse.Namespace, lm, caching: bool) -> dict[str, object]:
    max_len = a.system_len + a.turns * (a.user_len + a.output_len) + 16
    b = a.conversations
    cfg = EngineConfig(max_num_seqs=b, max_num_batched_tokens=max(a.chunk, b), max_prefill_chunk=a.chunk,
                       compile_in_background=False,  # all executables built before timing
                       max_model_len=max_len, page_size=16, dtype=a.dtype,
                       memory_fraction=a.memory_fraction, seq_buckets=(b,),
                       token_buckets=(max(a.chunk, b),), enable_prefix_caching=caching,
                       prefix_state_stride=a.stride, prefix_state_checkpoints=a.checkpoints)
    t0 = time.perf_counter()
    engine = LLMEngine(lm, cfg, show_progress=not a.smoke)
    startup = time.perf_counter() - t0
    vocab = lm.config.vocab_size
    rng = np.random.default_rng(0)  # the same workload in every mode
    system = rng.integers(3, vocab, a.system_len).tolist()
    users = [[rng.integers(3, vocab, a.user_len).tolist() for _ in range(a.turns)] for _ in range(b)]
    params = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    history = [list(system) for _ in range(b)]
    turn = [0] * b
    live: dict[str, tuple[int, float]] = {}  # request id -> (conversation, submit time)
    answers: dict[str, list[int]] = {}
    ttft, prompt_tokens, outputs, transcripts = [], 0, 0, [[] for _ in range(b)]

    def submit(c: int) -> None:
        nonlocal prompt_tokens
        history[c] += users[c][turn[c]]
        rid = engine.add_request(prompt_token_ids=list(history[c]), params=params)
        live[rid] = (c, time.perf_counter())
        answers[rid] = []
        prompt_tokens += len(history[c])

    t_start = time.perf_counter()
    for c in range(b):
        submit(c)
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for d in engine.step():
            c, t_sub = live[d.request_id]
            if d.token_ids and not answers[d.request_id]:
                ttft.append(time.perf_counter() - t_sub)
            answers[d.request_id] += d.token_ids
            outputs += len(d.token_ids)
            if d.finished:
                history[c] += answers[d.request_id]
                transcripts[c].append(answers[d.request_id])
                turn[c] += 1
                if turn[c] < a.turns:
                    submit(c)
    wall = time.perf_counter() - t_start
    s = engine.stats()
    out = {"mode": "on" if caching else "off", "startup_s": round(startup, 2), "wall_s": round(wall, 3),
           "requests": len(ttft), "steps": steps, "prompt_tokens": prompt_tokens, "output_tokens": outputs,
           "output_tok_per_s": round(outputs / wall, 1),
           "total_tok_per_s": round((prompt_tokens + outputs) / wall, 1),
           "ttft_mean_ms": round(1e3 * statistics.mean(ttft), 2),
           "ttft_p50_ms": round(1e3 * statistics.median(ttft), 2),
           "ttft_p90_ms": round(1e3 * float(np.percentile(ttft, 90)), 2),
           "prefix_cache_hit_tokens": s.get("prefix_cache_hit_tokens", 0),
           "prefix_cache_hit_rate": round(float(s.get("prefix_cache_hit_rate", 0.0)), 4),
           "checkpoint_pool_bytes": s.get("prefix_state_checkpoint_bytes", 0),
           "checkpoints_cached": s.get("prefix_state_checkpoints_cached", 0),
           "checkpoint_evictions": s.get("prefix_state_checkpoint_evictions", 0),
           "page_evictions": s.get("prefix_cache_page_evictions", {}),
           "kv_bytes": s["kv_bytes"], "state_bytes": s["state_bytes"],
           "transcripts": transcripts}
    return out


def main() -> None:
    a = parse()
    lm = load_model(a.model, dtype=a.dtype)
    print(f"{a.model} {a.dtype} on {jax.devices()[0].device_kind}: {a.conversations} conversations x "
          f"{a.turns} turns, system {a.system_len}, user {a.user_len}, output {a.output_len} tokens")
    results = []
    for mode in a.modes.split(","):
        results.append(run(a, lm, mode == "on"))
        gc.collect()  # the engine of the last mode (its device arrays) goes before the next
    for r in results:
        print(f"caching {r['mode']:>3}: wall {r['wall_s']:7.2f} s  TTFT mean {r['ttft_mean_ms']:8.1f} ms "
              f"p50 {r['ttft_p50_ms']:8.1f} p90 {r['ttft_p90_ms']:8.1f}  "
              f"out {r['output_tok_per_s']:7.1f} tok/s  hit {r['prefix_cache_hit_tokens']}/"
              f"{r['prompt_tokens']} ({100 * r['prefix_cache_hit_rate']:.1f}%)  "
              f"ckpt pool {r['checkpoint_pool_bytes'] / 2**20:.0f} MiB ({r['checkpoints_cached']} cached)  "
              f"{r['steps']} steps  start-up {r['startup_s']:.0f} s")
    summary = {"args": vars(a),
               "results": [{k: v for k, v in r.items() if k != "transcripts"} for r in results]}
    if len(results) == 2:
        off, on = results
        answers = [sum(r["transcripts"], []) for r in (off, on)]
        same = sum(x == y for x, y in zip(*answers, strict=True))
        summary |= {"speedup_wall": round(off["wall_s"] / on["wall_s"], 3),
                    "ttft_ratio_mean": round(off["ttft_mean_ms"] / on["ttft_mean_ms"], 3),
                    "answers_identical": f"{same}/{len(answers[0])}"}
        print(f"speed-up {summary['speedup_wall']}x wall, TTFT {summary['ttft_ratio_mean']}x; "
              f"answers identical on vs off: {summary['answers_identical']}")
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
