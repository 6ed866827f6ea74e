"""Quantization at load: a bf16 / f32 model's decoder Linears made FP8 (`quantization="fp8"`).

Each Linear of the decoder layers (and of Zamba2's shared blocks) gets a float8_e4m3fn
kernel with one f32 scale per 128 x 128 block, the format of the Hub's FP8 checkpoints
(hybrid_jax/layers/fp8.py), so a quantized model and a loaded FP8 checkpoint are served
by the same code. So do the MoE layers' stacked experts (each expert block-wise, on the
device that holds them: `quantize_stack`). Embeddings, norms, the LM head, the routers
and shared-expert gates (tiny) and the recurrent layers' own parameters stay as they are.
A model that already holds FP8 weights (an FP8 checkpoint) is left as loaded: its own
choice of unquantized modules stands (`left_as_loaded`).

When: a preset's expert stacks are quantized as they are drawn (`CausalLM(fp8_experts=)`,
layers/moe.py), its Linears after construction (`quantize_model`); an HF checkpoint's
tensors as they are read (`load_hf(quantization=)`); so the whole model is never held in
the load dtype. Knows nothing of serving.
"""

from __future__ import annotations

import jax
from flax import nnx

from hybrid_jax.layers.fp8 import quantize, quantize_experts, quantize_stack
from hybrid_jax.layers.linear import Linear
from hybrid_jax.layers.moe import MoE

QUANTIZATIONS = ("fp8",)
FP8_BLOCK = 128


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not supported: None or one of {QUANTIZATIONS}")


def fp8_linears(model: nnx.Module) -> list[str]:
    """The paths of the model's Linears and MoE layers that hold FP8 weights."""
    return [".".join(map(str, p)) for p, m in nnx.iter_graph(model)
            if isinstance(m, Linear | MoE) and m.quantized]


def left_as_loaded(model: nnx.Module) -> bool:
    """Whether `model` holds FP8 weights that quantization="fp8" leaves as they are: an FP8
    checkpoint's (its own choice of unquantized modules stands), or a quantization already
    done (`quantize_model`, or `load_hf(quantization=...)` as it read). MoE stacks quantized
    as they were drawn (`MoE.fp8_at_draw`: a preset loaded with quantization="fp8") do not
    count: the model's Linears are still to be quantized."""
    return any(isinstance(m, Linear | MoE) and m.quantized and not getattr(m, "fp8_at_draw", False)
               for _, m in nnx.iter_graph(model))


def quantizes(path: tuple, module: nnx.Module) -> bool:
    """Whether quantization="fp8" quantizes `module` at `path` (module doc): a decoder
    layer's (or shared block's) plain Linear, or a decoder layer's MoE stacks; not the MTP
    head's (speculative drafts keep the load dtype)."""
    if isinstance(module, Linear):
        return (bool(path) and path[0] in ("layers", "shared_blocks") and module.stack_row is None
                and not module.transposed)
    return isinstance(module, MoE) and bool(path) and path[0] == "layers"


def quantize_kernel(w: jax.Array, block: int = FP8_BLOCK) -> tuple[jax.Array, jax.Array]:
    """A Linear's kernel [in, out] -> (e4m3 kernel, f32 block scales), where it lives."""
    if on_accelerator(w):  # quantized on the device (a real-size model's 2 GB of Linears)
        return tuple(a[0] for a in quantize_stack(w[None], block))
    return quantize(w, block)  # host numpy: no compilation per weight shape


def on_accelerator(x) -> bool:
    return all(d.platform != "cpu" for d in getattr(x, "devices", lambda: set())())


def quantize_model(model: nnx.Module, quantization: str | None, block: int = FP8_BLOCK) -> nnx.Module:
    """`model` with its decoder Linears and MoE stacks quantized (module doc), in place;
    returned. A model `left_as_loaded` is returned as it is; MoE layers quantized as drawn
    keep their stacks."""
    check_quantization(quantization)
    if quantization is None or left_as_loaded(model):
        return model
    for path, m in list(nnx.iter_graph(model)):
        if not quantizes(path, m):
            continue
        if isinstance(m, Linear):
            m.set_fp8(*quantize_kernel(m.kernel[...], block), block)
        elif not m.quantized:
            for name in MoE.STACKS:
                if getattr(m, name) is not None:
                    m.set_fp8(name, *quantize_experts(getattr(m, name)[...], block, glu=name == "gate_up"),
                              block)
    return model
