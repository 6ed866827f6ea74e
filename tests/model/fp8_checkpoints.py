"""Tiny FP8 checkpoints for tests, written in the Hub's fine-grained FP8 format.

A random transformers model is saved, then its Linear weights are quantized block-wise
here with numpy and ml_dtypes (independently of hybrid_jax/layers/fp8.py): per B x B
block (edge blocks partial) scale = amax / 448, weight = e4m3(w / scale). The scales are
stored as float32 or bfloat16 (rounded to bf16 before quantizing, as the Qwen FP8
releases are). The torch model is then given the dequantized weights, so it is the
reference for the FP8 model.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0


def quantize_np(w: np.ndarray, block: int, scale_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """w [o, i] f32 -> (e4m3 [o, i], scales [ceil(o/B), ceil(i/B)] f32 values of scale_dtype)."""
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    scale = np.ones((bo, bi), np.float32)
    for r in range(bo):
        for c in range(bi):
            amax = np.abs(w[r * block:(r + 1) * block, c * block:(c + 1) * block]).max()
            if amax > 0:
                scale[r, c] = amax / E4M3_MAX
    if scale_dtype == "bfloat16":
        scale = scale.astype(ml_dtypes.bfloat16).astype(np.float32)
    full = np.kron(scale, np.ones((block, block), np.float32))[:o, :i]
    q = np.clip(w / full, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def dequantize_np(q: np.ndarray, scale: np.ndarray, block: int) -> np.ndarray:
    o, i = q.shape
    return q.astype(np.float32) * np.kron(scale, np.ones((block, block), np.float32))[:o, :i]


def _torch_fp8(q: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)


def write_fp8(hf_model: torch.nn.Module, out_dir: Path, *, block: int, scale_dtype: str,
              not_convert: tuple[str, ...] = (),
              extra: dict[str, torch.nn.Parameter] | None = None) -> list[str]:
    """Rewrite the checkpoint that `hf_model.save_pretrained(out_dir)` wrote in FP8 and give
    `hf_model` the dequantized weights. Quantizes every 2-D `*.weight` of the decoder
    layers whose module is a Linear, and the Linear weights of `extra` (name in the files
    -> the torch parameter given the dequantized weight: an MTP head's), except those in
    `not_convert`. Returns their names."""
    file = out_dir / "model.safetensors"
    tensors = load_file(file)
    extra = extra or {}
    linears = {name for name, mod in hf_model.named_modules() if isinstance(mod, torch.nn.Linear)}
    out, quantized, dequantized = {}, [], {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if ((name in extra or (name.endswith(".weight") and module in linears and ".layers." in name))
                and module not in not_convert):
            q, scale = quantize_np(t.float().numpy(), block, scale_dtype)
            out[name] = _torch_fp8(q)
            out[name + "_scale_inv"] = torch.from_numpy(scale).to(getattr(torch, scale_dtype))
            dequantized[name] = torch.from_numpy(dequantize_np(q, scale, block))
            quantized.append(name)
        else:
            out[name] = t
    save_file(out, file, metadata={"format": "pt"})
    cfg = json.loads((out_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block],
                                  "modules_to_not_convert": list(not_convert)}
    (out_dir / "config.json").write_text(json.dumps(cfg))
    params = dict(hf_model.named_parameters()) | extra
    with torch.no_grad():
        for name, w in dequantized.items():
            params[name].copy_(w)
    return quantized


def quantize_experts(out_dir: Path, params: dict[str, torch.nn.Parameter], *, block: int,
                     scale_dtype: str) -> int:
    """Quantize, in the checkpoint in `out_dir`, every expert stored one Linear each
    (`...experts.{j}.{gate,up,down}_proj.weight`, as Qwen3.5-FP8 stores them) and give the
    torch model's stacked experts (`params`: file stem -> `gate_up_proj` [e, 2f, d] /
    `down_proj` [e, d, f] by the stem's name, e.g. `model.layers.0.mlp.experts.gate_up_proj`)
    the dequantized values. Returns how many tensors were quantized."""
    file = out_dir / "model.safetensors"
    tensors = load_file(file)
    names = [n for n in tensors if ".experts." in n and n.endswith(("gate_proj.weight", "up_proj.weight",
                                                                     "down_proj.weight"))]
    with torch.no_grad():
        for name in names:
            stem, j, proj, _ = name.rsplit(".", 3)
            q, scale = quantize_np(tensors[name].float().numpy(), block, scale_dtype)
            tensors[name] = _torch_fp8(q)
            tensors[name + "_scale_inv"] = torch.from_numpy(scale).to(getattr(torch, scale_dtype))
            w = torch.from_numpy(dequantize_np(q, scale, block))
            if proj == "down_proj":
                params[f"{stem}.down_proj"][int(j)] = w
            else:
                f = w.shape[0]
                rows = slice(0, f) if proj == "gate_proj" else slice(f, 2 * f)
                params[f"{stem}.gate_up_proj"][int(j), rows] = w
    save_file(tensors, file, metadata={"format": "pt"})
    return len(names)
