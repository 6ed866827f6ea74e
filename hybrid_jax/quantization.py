"""Quantization at load: a bf16 / f32 model's decoder Linears made FP8 (`quantization="fp8"`).

Each Linear of the decoder layers (and of Zamba2's shared blocks) gets a float8_e4m3fn
kernel with one f32 scale per 128 x 128 block, the format of the Hub's FP8 checkpoints
(hybrid_jax/layers/fp8.py), so a quantized model and a loaded FP8 checkpoint are served
by the same code. So do the MoE layers' stacked experts (each expert block-wise, on the
device that holds them: `quantize_stack`). Embeddings, norms, the LM head, the routers
and shared-expert gates (tiny) and the recurrent layers' own parameters stay as they are.
A model that already holds FP8 weights (an FP8 checkpoint) is left as loaded: its own
choice of unquantized modules stands. Knows nothing of serving.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hybrid_jax.layers.fp8 import quantize, quantize_stack
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


def _on_accelerator(x) -> bool:
    return all(d.platform != "cpu" for d in getattr(x, "devices", lambda: set())())


def quantize_model(model: nnx.Module, quantization: str | None, block: int = FP8_BLOCK) -> nnx.Module:
    """`model` with its decoder Linears quantized (module doc), in place; returned."""
    check_quantization(quantization)
    if quantization is None or fp8_linears(model):
        return model
    for path, lin in list(nnx.iter_graph(model)):
        if (isinstance(lin, Linear) and path and path[0] in ("layers", "shared_blocks")
                and lin.stack_row is None and not lin.transposed):
            w = lin.kernel[...]
            if _on_accelerator(w):  # quantized where it lives (a real-size model's 2 GB of
                kernel, scale = (a[0] for a in quantize_stack(w[None], block))  # Linears)
            else:  # host numpy: no compilation per weight shape
                kernel, scale = quantize(w, block)
            lin.set_fp8(kernel, scale, block)
        elif isinstance(lin, MoE) and path and path[0] == "layers":
            for name in MoE.STACKS:
                if getattr(lin, name) is not None:
                    kernel, scale = _quantize_experts(getattr(lin, name)[...], block, glu=name == "gate_up")
                    lin.set_fp8(name, kernel, scale, block)
    return model


def _quantize_experts(w, block: int, glu: bool, chunk_bytes: int = 1 << 28):
    """`quantize_stack` over slices of at most `chunk_bytes` of experts, concatenated: the
    same values (each expert is quantized on its own), but the f32 temporaries of a slice
    instead of the whole stack's (a 35B-A3B layer's gate/up stack is 1 GiB in bf16, its f32
    temporaries several GiB: next to the rest of the bf16 model they do not fit one 80 GB GPU)."""
    per_expert = max(1, w[0].size * w.dtype.itemsize)
    step = max(1, chunk_bytes // per_expert)
    if step >= w.shape[0]:
        return quantize_stack(w, block, glu=glu)
    parts = [quantize_stack(w[i:i + step], block, glu=glu) for i in range(0, w.shape[0], step)]
    return jnp.concatenate([q for q, _ in parts]), jnp.concatenate([s for _, s in parts])
