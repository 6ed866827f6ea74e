"""Engine start-up with default settings: cold (empty compilation cache) or warm.

Cold on a GPU, the executables of steps over 64 sequences or 1024 tokens compile in the
background after start-up (EngineConfig.compile_in_background): startup_s is until the
engine serves, background_s how long after that they arrived.

Warm: every step executable comes from the executable store beside the cache
(serving/runner/exec_store.py), loaded without tracing. exec_load_s / exec_lower_s /
exec_compile_s split the runner's part; load_s is the model.

  PYTHONPATH=. python benchmarks/startup.py --cache-dir /tmp/xla-cache   # run twice: cold, then warm
"""

from __future__ import annotations

import argparse
import json
import os
import time

t_import = time.perf_counter()

import jax  # noqa: E402

from serving.engine.engine_config import EngineConfig  # noqa: E402
from serving.engine.llm_engine import LLMEngine  # noqa: E402
from serving.entrypoints.bench.common import emit  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="native-1b-parallel")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cold = not (os.path.isdir(a.cache_dir) and os.listdir(a.cache_dir))
    # Where start-up goes: loading the model, the engine without compiling, compiling.
    from serving.runner.runner import ModelRunner

    phases: dict[str, float] = {}
    compile_all = ModelRunner.compile_all

    def timed_compile(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return compile_all(self, *args, **kwargs)
        finally:
            phases["compile_s"] = phases.get("compile_s", 0.0) + time.perf_counter() - t

    ModelRunner.compile_all = timed_compile
    from hybrid_jax.loading import load_model

    t0 = time.perf_counter()
    lm = load_model(a.model, dtype=a.dtype)
    jax.block_until_ready(jax.tree.leaves(lm.model))
    phases["load_s"] = time.perf_counter() - t0
    engine = LLMEngine(lm, EngineConfig(dtype=a.dtype, compilation_cache_dir=a.cache_dir))
    dt = time.perf_counter() - t0
    phases["engine_other_s"] = dt - phases["load_s"] - phases.get("compile_s", 0.0)
    # The engine serves: greedy tokens of a few requests, digested (cold and warm must agree).
    import hashlib

    from serving.sample.sampling_params import SamplingParams

    out: dict[str, list[int]] = {}
    for i in range(4):
        engine.add_request(prompt_token_ids=[1 + i, 7, 11 + i, 3] * (4 + i), request_id=str(i),
                           params=SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished():
        for d in engine.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
    digest = hashlib.sha256(json.dumps(sorted(out.items())).encode()).hexdigest()[:16]
    # The executables compiled in the background (compile_in_background): until they are in.
    deferred = len(engine.runner.deferred)
    while engine.runner.deferred and engine.deferred_ready_s is None:
        if engine.background_ready():
            engine.install_background()
        else:
            time.sleep(0.05)
    res = {"model": a.model, "tokens_digest": digest, "cache": "cold" if cold else "warm",
           "startup_s": round(dt, 1),
           "executables": len(engine.runner.compiled) + len(engine.runner.samplers),
           "buckets": [(b.tokens, b.seqs, b.decode) for b in engine.runner.buckets],
           "import_s": round(t0 - t_import, 1), "device": str(jax.devices()[0]),
           "executables_loaded": engine.runner.startup["loaded"], "executables_deferred": deferred,
           # from the end of the serving start-up to the deferred executables' arrival
           "background_s": engine.deferred_ready_s and round(engine.deferred_ready_s, 1),
           **{f"exec_{k}": round(v, 2) for k, v in engine.runner.startup.items() if k.endswith("_s")},
           **{k: round(v, 1) for k, v in phases.items()}}
    emit(a.out, res)


if __name__ == "__main__":
    main()
