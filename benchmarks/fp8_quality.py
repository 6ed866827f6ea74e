"""FP8 quality: bf16 against FP8 quantized at load (issue 43, "Quality").

1. The shipped default model (configs/default_model): held-out loss and bits per byte in
   bf16 and with `quantization="fp8"` (128 x 128 blocks, e4m3, at load), over the held-out
   files of the training docs (`benchmarks/code_eval.held_out_loss`: each file
   `<bos> text <eos>`, rows of 512 as training packs them), and their relative difference.
   This is the full-sequence forward (no paged cache), so `kv_cache_dtype` does not apply
   to it (FP8 KV's accuracy on this model: benchmarks/fp8_kv_accuracy.py).
2. A real-size preset with random weights (default native-1b-parallel), bf16 against the
   same weights quantized at load: the next-token logits at every position of random
   prompts, their cosine similarity (mean / min over positions) and top-1 agreement; as a
   yardstick the same figures for bf16 against f32 compute over the same weights. With
   `--kv`: the same prompts through the engine (bf16 KV pages against FP8 KV pages, per-head
   scales, both with FP8 weights) compared on the greedy tokens after each prompt while
   both runs agree (top-1 agreement; |logprob error| of the reference's token), the first
   token (prefill) apart from the decode steps (which read every key from the pages).

On a CPU (where this runs: it is a quality figure, not a timing) the FP8 Linears take the
dequantize path: e4m3 times its block scales, then the product in bf16
(hybrid_jax/layers/fp8.py, `fp8_matmul` with the kernel switch at "reference"); the script
records the switch. Usage:
    PYTHONPATH=. python benchmarks/fp8_quality.py --out fp8_quality.json
    PYTHONPATH=. python benchmarks/fp8_quality.py --skip-held-out --preset native-1b-parallel --kv
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks.code_eval import held_out_loss
from hybrid_jax.loading import load_model
from hybrid_jax.quantization import fp8_linears, quantize_model
from pallas_kernels.backend import default_impl

MANIFEST = Path(__file__).resolve().parent.parent / "configs/default_model/corpus.json"


def held_out(model: str, manifest: Path, seq_len: int, batch: int) -> dict:
    out = {}
    for name, q in (("bf16", None), ("fp8", "fp8")):
        t0 = time.perf_counter()
        out[name] = held_out_loss(model, manifest, {}, seq_len, batch, dtype="bfloat16", quantization=q)
        out[name]["seconds"] = time.perf_counter() - t0
        print(name, json.dumps(out[name]), flush=True)
    b, f = out["bf16"], out["fp8"]
    out["loss_rel_diff"] = (f["loss"] - b["loss"]) / b["loss"]
    out["bpb_rel_diff"] = (f["bits_per_byte"] - b["bits_per_byte"]) / b["bits_per_byte"]
    out["within_1pct"] = abs(out["loss_rel_diff"]) <= 0.01
    return out


def _logits_fn(model: nnx.Module):
    """A jitted logits function with the parameters as arguments (not HLO constants)."""
    graph, state = nnx.split(model)

    @jax.jit
    def f(state, ids):
        return nnx.merge(graph, state)(ids).astype(jnp.float32)

    return lambda ids: f(state, ids)


def _all_logits(model: nnx.Module, prompts: np.ndarray, batch: int) -> np.ndarray:
    f = _logits_fn(model)
    return np.concatenate([np.asarray(f(jnp.asarray(prompts[i:i + batch])))
                           for i in range(0, len(prompts), batch)])


def logits_agreement(ref: np.ndarray, got: np.ndarray) -> dict:
    """ref, got [n, t, v] f32 -> cosine similarity per position (mean, min) and top-1 agreement."""
    r = ref.reshape(-1, ref.shape[-1]).astype(np.float64)
    g = got.reshape(-1, got.shape[-1]).astype(np.float64)
    cos = (r * g).sum(-1) / (np.linalg.norm(r, axis=-1) * np.linalg.norm(g, axis=-1))
    top1 = r.argmax(-1) == g.argmax(-1)
    last = ref[:, -1].argmax(-1) == got[:, -1].argmax(-1)
    return {"positions": int(len(cos)), "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min()),
            "top1_agreement": float(top1.mean()), "top1_agreement_last_position": float(last.mean()),
            "rel_l2_err_mean": float((np.linalg.norm(r - g, axis=-1) / np.linalg.norm(r, axis=-1)).mean())}


def preset_logits(preset: str, n: int, length: int, batch: int, seed: int) -> tuple[dict, np.ndarray]:
    """bf16 against FP8 at load, and, as the yardstick, bf16 against f32 compute over the same
    (bf16) weights: how far bf16's own rounding moves this random model's logits."""
    from hybrid_jax.model import CausalLM

    lm = load_model(preset, dtype="bfloat16", seed=seed)
    prompts = np.random.default_rng(seed).integers(0, lm.config.vocab_size, (n, length), dtype=np.int32)
    t0 = time.perf_counter()
    ref = _all_logits(lm.model, prompts, batch)
    t1 = time.perf_counter()
    f32 = nnx.eval_shape(lambda: CausalLM(lm.config, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    nnx.update(f32, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(lm.model)))
    wide = _all_logits(f32, prompts, batch)
    del f32
    t2 = time.perf_counter()
    quantize_model(lm.model, "fp8")
    got = _all_logits(lm.model, prompts, batch)
    res = {"preset": preset, "prompts": n, "prompt_len": length, "seed": seed,
           "fp8_linears": len(fp8_linears(lm.model)), "seconds_bf16": t1 - t0, "seconds_f32": t2 - t1,
           "seconds_quantize_and_fp8": time.perf_counter() - t2,
           "fp8_vs_bf16": logits_agreement(ref, got), "bf16_vs_f32": logits_agreement(wide, ref),
           "fp8_vs_f32": logits_agreement(wide, got)}
    print(json.dumps(res), flush=True)
    return res, prompts


def kv_agreement(preset: str, prompts: np.ndarray, seed: int, steps: int = 16) -> dict:
    """bf16 engines with FP8 weights: bf16 KV pages against FP8 KV pages (per-head scales)."""
    from serving.engine.engine_config import EngineConfig
    from serving.engine.llm_engine import LLMEngine
    from serving.entrypoints.llm import LLM
    from serving.sample.sampling_params import SamplingParams

    n, length = prompts.shape
    runs = {}
    for kv in ("auto", "fp8"):
        lm = load_model(preset, dtype="bfloat16", seed=seed, quantization="fp8")
        cfg = EngineConfig(dtype="bfloat16", kv_cache_dtype=kv, max_num_seqs=8, max_num_batched_tokens=256,
                           max_prefill_chunk=256, max_model_len=256, page_size=16, seq_buckets=(8,),
                           token_buckets=(256,))
        llm = LLM.from_engine(LLMEngine(lm, cfg, show_progress=False))
        outs = llm.generate(prompt_token_ids=prompts.tolist(), sampling_params=SamplingParams(
            temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=5))
        runs[kv] = [list(zip(o.token_ids, o.logprobs, strict=True)) for o in outs]
        del llm, lm
    # The first token is sampled in the prefill step, whose attention may read the prompt's
    # K/V before the pages (it showed no FP8 error at all); the later ones are decode steps,
    # which read every key from the pages. Each sequence is compared while both runs agree on
    # its tokens so far (same prefix): top-1 agreement and |logprob error| of the reference's
    # token at each such step, apart for the first token and the decode steps.
    first, later = ([], []), ([], [])
    for ref, got in zip(runs["auto"], runs["fp8"], strict=True):
        for j, ((rt, rl), (gt, gl)) in enumerate(zip(ref, got, strict=True)):
            agree, err = first if j == 0 else later
            agree.append(rt == gt)
            if rt in gl:
                err.append(abs(gl[rt] - rl[rt]))
            if rt != gt:
                break
    stat = lambda pair: {"steps": len(pair[0]), "top1_agreement": float(np.mean(pair[0])),  # noqa: E731
                         "logprob_err_mean": float(np.mean(pair[1])) if pair[1] else None,
                         "logprob_err_max": float(np.max(pair[1])) if pair[1] else None}
    res = {"prompts": n, "prompt_len": length, "max_tokens": steps, "first_token": stat(first),
           "decode_steps": stat(later)}
    print(json.dumps(res), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="the model of part 1 (default: the shipped one)")
    p.add_argument("--held-out", type=Path, default=MANIFEST,
                   help="a corpus.json whose held_out_files are scored")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--skip-held-out", action="store_true")
    p.add_argument("--preset", default="native-1b-parallel", help="the preset of part 2 ('' skips it)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--preset-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv", action="store_true", help="also FP8 KV pages through the engine (part 2)")
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    res: dict = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "backend": jax.default_backend(),
                 "machine": platform.processor() or platform.machine(), "jax": jax.__version__,
                 "kernels": default_impl()}
    print(json.dumps(res), flush=True)
    if not a.skip_held_out:
        res["held_out"] = held_out(a.model, a.held_out, a.seq_len, a.batch)
    if a.preset:
        res["preset_logits"], prompts = preset_logits(a.preset, a.prompts, a.prompt_len,
                                                      a.preset_batch, a.seed)
        if a.kv:
            res["preset_kv"] = kv_agreement(a.preset, prompts, a.seed)
    print(json.dumps(res, indent=1))
    if a.out is not None:
        a.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
