"""MTP speculative decoding: the cost of a verification step against a plain decode step.

The overhead that acceptance must pay for. A preset gets a random MTP head
(`--mtp-layers`, default 1; random weights: acceptance ~0, so every step verifies k
drafts and keeps ~1 token). For each batch size b, two engines serve b greedy requests
(prompt `--prompt-len`, ignore_eos): speculation off, and speculative_method="mtp" with
k = `--k`. Once every sequence decodes, `--steps` engine steps are timed (wall clock,
host included): a plain step is one overlapped decode step; an MTP step is the
verification executable (target over k + 1 tokens per sequence, acceptance, state
choice) plus the MTP step (the head over the k + 1 positions, then k - 1 one-token
drafting steps) and the drafts' transfer. The plain engine is the one without MTP:
its step does not compute the hidden states. Prints one JSON line per batch size:
plain_step_ms, mtp_step_ms, ratio, and the acceptance seen (verify time and draft
time from stats() too).

  # H100 (the lead runs it): native-1b-parallel with a one-layer head, bf16
  PYTHONPATH=. python benchmarks/mtp_step.py --model native-1b-parallel --dtype bfloat16 --k 2
  PYTHONPATH=. python benchmarks/mtp_step.py --smoke   # CPU toy run (native-tiny)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import time

import numpy as np
from flax import nnx

from hybrid_jax.loading import DTYPES, LoadedModel
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_params import SamplingParams


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel", help="a preset (random weights)")
    p.add_argument("--mtp-layers", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--memory-fraction", type=float, default=0.5)
    p.add_argument("--smoke", action="store_true", help="CPU toy run (native-tiny, short)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    a = p.parse_args()
    if a.smoke:
        a.model, a.dtype, a.batches, a.prompt_len, a.steps = "native-tiny", "float32", "1,4", 16, 5
    return a


def model_with_head(a: argparse.Namespace) -> LoadedModel:
    cfg = dataclasses.replace(load_preset(a.model), mtp_num_hidden_layers=a.mtp_layers)
    return LoadedModel(CausalLM(cfg, dtype=DTYPES[a.dtype], rngs=nnx.Rngs(0)), cfg, None, a.model)


def step_ms(a: argparse.Namespace, lm: LoadedModel, b: int, mtp: bool) -> dict[str, float]:
    """Mean wall time of an engine step once all b sequences decode."""
    spec = dict(speculative_method="mtp", num_speculative_tokens=a.k,
                speculative_disable_by_batch_size=None) if mtp else {}
    cfg = EngineConfig(max_num_seqs=b, max_model_len=a.prompt_len + 4 * a.steps * (a.k + 1) + 64,
                       compile_in_background=False,  # all executables built before timing
                       dtype=a.dtype, memory_fraction=a.memory_fraction, **spec)
    eng = LLMEngine(lm, cfg, show_progress=False)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=4 * a.steps * (a.k + 1), ignore_eos=True)
    for _ in range(b):
        eng.add_request(prompt_token_ids=rng.integers(0, lm.config.vocab_size, a.prompt_len).tolist(),
                        params=params)
    while any(s.num_output_tokens < 2 for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):  # warm: the first verification and MTP calls
        eng.step()
    before = eng.stats()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    eng.step()  # drains an overlapped step still in flight
    ms = (time.perf_counter() - t0) / (a.steps + 1) * 1e3
    after = eng.stats()
    out = {"step_ms": ms}
    if mtp:
        n = after["spec_verify_steps"] - before["spec_verify_steps"]
        per = lambda key: (after[key] - before[key]) / max(n, 1) * 1e3  # noqa: E731
        out |= {"verify_steps": n, "acceptance": after["spec_acceptance_rate"],
                "verify_ms": per("spec_verify_time_s"), "draft_fetch_ms": per("spec_draft_time_s")}
    del eng
    gc.collect()
    return out


def main() -> None:
    a = parse()
    lm = model_with_head(a)
    for b in (int(x) for x in a.batches.split(",")):
        plain, mtp = step_ms(a, lm, b, mtp=False), step_ms(a, lm, b, mtp=True)
        row = {"model": a.model, "mtp_layers": a.mtp_layers, "dtype": a.dtype, "k": a.k, "batch": b,
               "plain_step_ms": round(plain["step_ms"], 3), "mtp_step_ms": round(mtp["step_ms"], 3),
               "ratio": round(mtp["step_ms"] / plain["step_ms"], 3),
               **{f"mtp_{k}": (round(v, 3) if isinstance(v, float) else v) for k, v in mtp.items()
                  if k != "step_ms"}}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
