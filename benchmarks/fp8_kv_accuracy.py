"""FP8 KV cache accuracy: per-head against per-tensor scales, against the f32 KV cache.

Serves the same requests with engines that differ only in their K/V pages (f32 compute):
the f32 reference (kv_cache_dtype "auto"), FP8 with per-KV-head scales and FP8 with one
scale per layer; and, as a yardstick, a bf16 engine (bf16 compute and bf16 pages).

- next token: 64 prompts (random ids, lengths 16..240) with max_tokens=1 and logprobs=5:
  top-1 agreement with the reference, and |logprob error| of the reference's top-1 token
  (mean and max).
- greedy: 8 prompts of 64 random ids, 32 tokens each: prompts whose 32 tokens equal the
  reference's, and the mean number of tokens before the first difference.

Runs on CPU (minutes: four engines compile). Usage:
    PYTHONPATH=. python benchmarks/fp8_kv_accuracy.py --model default
    PYTHONPATH=. python benchmarks/fp8_kv_accuracy.py --model native-tiny
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from hybrid_jax.loading import load_model
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams

VARIANTS = {
    "f32 KV (reference)": dict(dtype="float32"),
    "fp8 KV, per-head scales": dict(dtype="float32", kv_cache_dtype="fp8", kv_scale="head"),
    "fp8 KV, per-tensor scales": dict(dtype="float32", kv_cache_dtype="fp8", kv_scale="tensor"),
    "bf16 engine (bf16 KV)": dict(dtype="bfloat16"),
}


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(1)
    nxt = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(16, 240, 64)]
    greedy = [rng.integers(0, vocab, 64).tolist() for _ in range(8)]
    return nxt, greedy


def run(model: str, variant: dict) -> tuple[list, list]:
    lm = load_model(model, dtype=variant["dtype"])
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, max_prefill_chunk=256,
                       max_model_len=256, page_size=16, seq_buckets=(8,), token_buckets=(256,),
                       **variant)
    llm = LLM.from_engine(LLMEngine(lm, cfg, show_progress=False))
    nxt, greedy = prompts(lm.config.vocab_size)
    one = llm.generate(prompt_token_ids=nxt, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5))
    gen = llm.generate(prompt_token_ids=greedy, sampling_params=SamplingParams(
        temperature=0.0, max_tokens=32, ignore_eos=True))
    return [(o.token_ids[0], o.logprobs[0]) for o in one], [o.token_ids for o in gen]


def compare(ref, got) -> dict:
    (ref_one, ref_gen), (one, gen) = ref, got
    top1 = np.mean([a[0] == b[0] for a, b in zip(ref_one, one, strict=True)])
    # the reference's top-1 token's logprob, where the variant's top-5 holds it
    err = [abs(b[1][a[0]] - a[1][a[0]]) for a, b in zip(ref_one, one, strict=True) if a[0] in b[1]]
    same = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
            for a, b in zip(ref_gen, gen, strict=True)]
    return {"top1_agreement": float(top1), "logprob_err_mean": float(np.mean(err)),
            "logprob_err_max": float(np.max(err)), "greedy_identical": f"{sum(s == 32 for s in same)}/8",
            "greedy_tokens_before_first_difference": float(np.mean(same))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    a = p.parse_args()
    results = {name: run(a.model, v) for name, v in VARIANTS.items()}
    ref = results["f32 KV (reference)"]
    rows = {name: compare(ref, r) for name, r in results.items() if r is not ref}
    print(f"model {a.model}")
    print("| variant | next-token top-1 agreement | logprob error mean / max | greedy 32 tokens identical "
          "| tokens before first difference |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        err = f"{r['logprob_err_mean']:.4f} / {r['logprob_err_max']:.4f}"
        first = r["greedy_tokens_before_first_difference"]
        print(f"| {name} | {r['top1_agreement']:.3f} | {err} | {r['greedy_identical']} | {first:.1f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
