"""quantization="fp8" at load without the whole model in the load dtype: a preset's expert
stacks are quantized as they are drawn, an HF checkpoint's weights as they are read.

The reference is the plain path: the model built (or loaded) whole in bf16, then
`quantize_model`. Every parameter must be bit-identical to it (FP8 kernels, scales, and
what stays bf16, the MTP head included). The memory bound is checked where the expert
stacks are quantized (`quantize_stack`, wrapped): the bf16 expert stacks alive on the
device at each call, counted from `jax.live_arrays()`, stay within one layer's, where
the plain path holds every layer's (checked too, so the measure can tell them apart).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrid_jax.layers import fp8
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.moe import MoE
from hybrid_jax.loading import load_model
from hybrid_jax.model import CausalLM
from hybrid_jax.presets import load_preset
from hybrid_jax.quantization import left_as_loaded, quantize_model

PRESET = "qwen3.5-moe-tiny"


def _params(model) -> dict[str, tuple[str, tuple, bytes]]:
    return {".".join(map(str, p)): (str(v.get_value().dtype), v.get_value().shape,
                                    np.asarray(v.get_value()).tobytes())
            for p, v in nnx.to_flat_state(nnx.state(model))}


def _assert_identical(got, want) -> None:
    a, b = _params(got), _params(want)
    assert a.keys() == b.keys()
    differ = [k for k in a if a[k] != b[k]]
    assert not differ, f"{len(differ)} parameters differ, e.g. {differ[:3]}"


class _LiveStacks:
    """Wraps fp8.quantize_stack: at each call, the bytes of bf16 [e, ., .] arrays alive on the
    device that were not alive before (`start`)."""

    def __init__(self, monkeypatch, experts: int):
        self.experts, self.seen, self.baseline = experts, [], set()
        inner = fp8.quantize_stack

        def wrapped(w, *a, **kw):
            self.seen.append(sum(x.nbytes for x in jax.live_arrays()
                                 if id(x) not in self.baseline and x.dtype == jnp.bfloat16
                                 and x.ndim == 3 and x.shape[0] == experts))
            return inner(w, *a, **kw)

        monkeypatch.setattr(fp8, "quantize_stack", wrapped)

    def start(self) -> None:
        self.seen, self.baseline = [], {id(x) for x in jax.live_arrays()}


def _layer_stack_bytes(cfg) -> int:
    e, d, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size
    return 2 * (e * d * 2 * f + e * f * d)  # gate/up and down, bf16


def test_preset_experts_quantized_as_drawn_equal_the_plain_path(monkeypatch):
    cfg = load_preset(PRESET)
    live = _LiveStacks(monkeypatch, cfg.moe.num_experts)
    layer = _layer_stack_bytes(cfg)

    live.start()
    plain = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    quantize_model(plain, "fp8")
    # the plain path quantizes with every layer's bf16 stacks alive (and the MTP head's)
    assert max(live.seen) >= len(cfg.layers) * layer

    live.start()
    lm = load_model(PRESET, dtype="bfloat16", quantization="fp8")
    assert len(live.seen) == 2 * len(cfg.layers)  # each decoder layer's two stacks, as drawn
    assert max(live.seen) <= layer, (max(live.seen), layer)

    _assert_identical(lm.model, plain)
    model = lm.model
    assert all(layer.moe.quantized and layer.moe.fp8_at_draw for layer in model.layers)
    assert all(m.quantized for p, m in nnx.iter_graph(model.layers) if isinstance(m, Linear))
    head = model.mtp.layers[0].moe  # the MTP head stays bf16, its experts included
    assert not head.quantized and head.gate_up[...].dtype == jnp.bfloat16
    assert not any(m.quantized for _, m in nnx.iter_graph(model.mtp) if isinstance(m, Linear | MoE))
    assert left_as_loaded(model)  # done: a second quantization leaves it as it is
    before = _params(model)
    quantize_model(model, "fp8")
    assert _params(model) == before


def test_experts_quantized_as_drawn_still_get_their_linears_quantized():
    """The stacks quantized at draw do not make a model `left_as_loaded` (an FP8 checkpoint's
    FP8 weights do): its Linears are quantized after construction."""
    cfg = load_preset(PRESET)
    model = CausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1), fp8_experts=128)
    assert not left_as_loaded(model)
    q_proj = model.layers[3].attention.q_proj
    assert not q_proj.quantized
    quantize_model(model, "fp8")
    assert q_proj.quantized and left_as_loaded(model)


torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hybrid_jax.checkpoints import load_hf  # noqa: E402
from tests.model import hf_models  # noqa: E402
from tests.serving.qwen_mtp_helpers import build_with_mtp  # noqa: E402


@pytest.mark.parametrize("arch", ["qwen3_5_moe_vlm", "granite_moe"])
def test_hf_weights_quantized_as_read_equal_load_then_quantize(arch, tmp_path, monkeypatch):
    """Qwen3.5-MoE (experts one Linear each, stacked at load; an MTP head) and Granite
    (stored stacks)."""
    if arch == "qwen3_5_moe_vlm":
        build_with_mtp(arch, tmp_path, seed=0)
    else:
        hf_models.build(arch, tmp_path, seed=0)
    plain, cfg = load_hf(tmp_path, dtype=jnp.bfloat16)
    quantize_model(plain, "fp8")
    live = _LiveStacks(monkeypatch, cfg.moe.num_experts)
    live.start()
    model, _ = load_hf(tmp_path, dtype=jnp.bfloat16, quantization="fp8")
    moe_layers = sum(s.moe for s in cfg.layers)
    assert len(live.seen) == 2 * moe_layers and max(live.seen) <= _layer_stack_bytes(cfg)
    _assert_identical(model, plain)
    assert all(layer.moe.quantized for layer in model.layers if layer.moe is not None)
    if model.mtp is not None:
        assert not model.mtp.layers[0].moe.quantized
    # through load_model, as the engine loads it
    _assert_identical(load_model(str(tmp_path), dtype="bfloat16", quantization="fp8").model, plain)
    # without quantization: as before
    assert not any(m.quantized for _, m in nnx.iter_graph(load_hf(tmp_path, dtype=jnp.bfloat16)[0])
                   if isinstance(m, Linear | MoE))
