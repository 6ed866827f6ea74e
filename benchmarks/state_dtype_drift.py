"""Output drift of a bfloat16 recurrent state (`ssm_state_dtype`) against the float32 state.

Runs the same greedy requests twice through the engine, once with each state dtype, and
reports per request where the outputs first differ, the share of identical output
tokens before that point, and the largest difference of the chosen token's logprob over
the common prefix. The default model is trained (its logits are peaked, as a served
model's are); a random-weight preset shows the worst case (near-flat logits, where any
rounding can flip an argmax).

  PYTHONPATH=. python benchmarks/state_dtype_drift.py --model default --requests 16 --max-tokens 256
  PYTHONPATH=. python benchmarks/state_dtype_drift.py --model native-1b-parallel --dtype bfloat16
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from serving.entrypoints.bench.common import emit
from serving.entrypoints.llm import DEFAULT_MODEL, LLM
from serving.sample.sampling_params import SamplingParams

PROMPTS = [
    "def fibonacci(n):", "import numpy as np\n\n\ndef", "class Stack:\n    def __init__(self):",
    "for i in range(10):", "def parse_args():\n    parser = argparse.ArgumentParser(",
    "with open(path) as f:", "def quicksort(xs):", "if __name__ == '__main__':",
]


def run(model: str, dtype: str, state: str, prompts, ids, max_tokens: int):
    llm = LLM(model, dtype=dtype, ssm_state_dtype=state, show_progress=False,
              max_num_seqs=len(prompts or ids))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    if prompts:
        outs = llm.generate(prompts, params)
    else:
        outs = llm.generate(prompt_token_ids=ids, sampling_params=params)
    return [(o.token_ids, [lp[t] for lp, t in zip(o.logprobs, o.token_ids, strict=True)]) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="'default' (the shipped model) or a preset / path")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts (non-default models)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out")
    a = ap.parse_args()
    model = DEFAULT_MODEL if a.model == "default" else a.model
    prompts = ids = None
    if a.model == "default":
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(a.requests)]
    else:
        rng = np.random.default_rng(0)
        ids = [rng.integers(3, 1000, a.prompt_len).tolist() for _ in range(a.requests)]
    ref = run(model, a.dtype, "float32", prompts, ids, a.max_tokens)
    low = run(model, a.dtype, "bfloat16", prompts, ids, a.max_tokens)
    first, same, dlp = [], [], []
    for (t32, l32), (t16, l16) in zip(ref, low, strict=True):
        d = next((i for i, (x, y) in enumerate(zip(t32, t16, strict=True)) if x != y), len(t32))
        first.append(d)
        same.append(sum(x == y for x, y in zip(t32, t16, strict=True)) / len(t32))
        if d:
            dlp.append(max(abs(x - y) for x, y in zip(l32[:d], l16[:d], strict=True)))
    row = {"model": a.model, "dtype": a.dtype, "requests": a.requests, "max_tokens": a.max_tokens,
           "identical_requests": sum(d == a.max_tokens for d in first),
           "first_divergence_median": statistics.median(first), "first_divergence_min": min(first),
           "tokens_equal_share": statistics.mean(same),
           "max_logprob_diff_common_prefix": max(dlp) if dlp else None}
    emit(a.out, row)


if __name__ == "__main__":
    main()
