"""The executable store's checks on a host of 2 CPU devices, run in a child process
(a stored executable once loaded onto every device of the host: issue 38).

`tests/serving/test_exec_store.py` starts this script with
XLA_FLAGS=--xla_force_host_platform_device_count=2 (the pytest process has initialised
JAX with one device) and reads the JSON it prints: one entry per check, "ok" or the
failure. The store is the one engines find themselves (HYBRID_JAX_EXECUTABLE_STORE=1
beside the compilation cache directory given on the command line), as `hybrid-jax serve`
uses it. Tiny random models keep the compilations short.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import serving.runner.exec_store as exec_store
from hybrid_jax.config import AttentionConfig, LayerSpec, Mamba2Config, MLPConfig, ModelConfig
from hybrid_jax.loading import LoadedModel
from hybrid_jax.model import CausalLM
from serving.engine.engine_config import EngineConfig
from serving.engine.llm_engine import LLMEngine
from serving.entrypoints.llm import LLM
from serving.sample.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 13, 7, 22, 3], [4, 8, 100, 127]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Two models of one vocabulary: B (shardable over 2 devices) and A (a hybrid).
MODEL_A = ModelConfig(
    architecture="store-test-a", vocab_size=128, hidden_size=32,
    layers=(LayerSpec("hybrid", 16), LayerSpec("mlp")),
    attention=AttentionConfig(num_heads=2, num_kv_heads=1, head_dim=16),
    mamba2=Mamba2Config(num_heads=4, head_dim=8, state_size=8, n_groups=1, chunk_size=16),
    mlp=MLPConfig(intermediate_size=64))
MODEL_B = ModelConfig(
    architecture="store-test-b", vocab_size=128, hidden_size=32, layers=(LayerSpec("attention"),),
    attention=AttentionConfig(num_heads=2, num_kv_heads=2, head_dim=16), mlp=MLPConfig(intermediate_size=64))


def engine(cfg: ModelConfig, cache_dir: str, tp: int = 1) -> LLMEngine:
    model = CausalLM(cfg, rngs=nnx.Rngs(0))  # the same weights at every start
    settings = EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, max_prefill_chunk=16,
                            max_model_len=64, page_size=8, seq_buckets=(2,), token_buckets=(16,),
                            tensor_parallel_size=tp, compilation_cache_dir=cache_dir)
    return LLMEngine(LoadedModel(model, cfg, None, "test"), settings, show_progress=False)


def serve(eng: LLMEngine) -> list[list[int]]:
    outs = LLM.from_engine(eng).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    return [o.token_ids for o in outs]


def reference(cfg: ModelConfig) -> list[list[int]]:
    """Greedy tokens of the full-sequence forward pass (no cache, no engine), over a row
    padded on the right to one length (causal: the padding never reaches the last real
    position), so it compiles once."""
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    width = max(map(len, PROMPTS)) + GREEDY.max_tokens
    forward = jax.jit(lambda row: model(row[None])[0])
    out = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(GREEDY.max_tokens):
            row = jnp.asarray(tokens + [0] * (width - len(tokens)), jnp.int32)
            tokens.append(int(jnp.argmax(forward(row)[len(tokens) - 1])))
        out.append(tokens[len(prompt):])
    return out


def check_mismatch_is_a_miss(tmp: Path) -> None:
    """An executable stored for device 0 is refused where it would not fit: loaded onto
    every device (what jax does without execution_devices), called with arguments on
    another device or sharded over both. A refusal is a miss, never an error."""
    from jax.experimental.serialize_executable import deserialize_and_load, serialize

    d0, d1 = jax.devices()[:2]
    x = jax.device_put(jnp.arange(4.0), d0)
    compiled = jax.jit(lambda a: a * 2).lower(x).compile()
    store = exec_store.ExecutableStore(tmp / "unit", [d0])
    store.save("k", compiled)
    loaded = store.load("k", (x,))
    assert loaded is not None and store.hits == 1
    np.testing.assert_array_equal(loaded(x), [0.0, 2.0, 4.0, 6.0])

    payload, in_tree, out_tree = serialize(compiled)
    everywhere = deserialize_and_load(payload, in_tree, out_tree)  # jax's default placement
    why = exec_store.mismatch(everywhere, exec_store.signature(compiled), (x,), [d0])
    assert why is not None and "devices" in why, why

    on_d1 = jax.device_put(jnp.arange(4.0), d1)
    assert store.load("k", (on_d1,)) is None and store.rejected == 1
    mesh = Mesh(np.asarray([d0, d1]), ("tp",))
    split = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec("tp")))
    assert store.load("k", (split,)) is None and store.rejected == 2
    other = exec_store.ExecutableStore(tmp / "unit", [d1])  # a store for device 1 only
    assert other.load("k", (on_d1,)) is None and other.hits == 0


def main() -> None:
    cache = Path(sys.argv[1])
    os.environ["HYBRID_JAX_EXECUTABLE_STORE"] = "1"
    results: dict[str, str] = {}
    stores: list = []
    make = exec_store.default_store
    exec_store.default_store = lambda devices: stores.append(make(devices)) or stores[-1]

    def check(name, fn) -> None:
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc(limit=4)

    check("mismatch_is_a_miss", lambda: check_mismatch_is_a_miss(cache))

    def tensor_parallel_then_another_model_twice() -> None:
        # B over both devices fills the store first; A then starts twice on device 0.
        sharded = engine(MODEL_B, str(cache), tp=2)
        tokens = serve(sharded)
        assert stores[-1].devices == tuple(jax.devices()[:2])
        again = engine(MODEL_B, str(cache), tp=2)  # a tensor-parallel warm start loads everything
        assert again.runner.startup["loaded"] == sharded.runner.startup["executables"]
        assert serve(again) == tokens
        del sharded, again
        first = engine(MODEL_A, str(cache))
        n = first.runner.startup["executables"]
        assert first.runner.startup["loaded"] == 0 and stores[-1].misses == n
        expected = serve(first)
        assert expected == reference(MODEL_A), "served tokens differ from the full forward's"
        second = engine(MODEL_A, str(cache))
        assert second.runner.startup["loaded"] == n and stores[-1].hits == n, vars(stores[-1])
        assert serve(second) == expected, "a warm start serves other tokens"

    check("tensor_parallel_then_another_model_twice", tensor_parallel_then_another_model_twice)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
