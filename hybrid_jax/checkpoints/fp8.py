"""FP8 checkpoints: the Hub's "fine-grained FP8" format (DeepSeek-V3, Qwen3 / Qwen3.5 FP8).

config.json carries `quantization_config` {quant_method: "fp8", fmt: "e4m3",
activation_scheme: "dynamic", weight_block_size: [B, B], modules_to_not_convert: [...]}.
A quantized Linear stores `X.weight` in float8_e4m3fn [out, in] and
`X.weight_scale_inv` [ceil(out/B), ceil(in/B)] in float32 or bfloat16; the real weight
is their product over each B x B block (hybrid_jax/layers/fp8.py). Which tensors are
quantized is read from the files, tensor by tensor (embeddings, norms, the LM head,
recurrent parameters and the modules the config names stay unquantized); the config
only has to agree with them. Other quantization configs are refused naming the field.
This module checks and reads; hybrid_jax/checkpoints/hf.py places the arrays.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
FP8_STORED = "F8_E4M3"
SCALE_STORED = ("F32", "BF16")


@dataclass(frozen=True)
class Fp8Format:
    """A checked `quantization_config`."""

    block: int
    not_convert: tuple[str, ...] = ()

    def excluded(self, module: str) -> bool:
        """Whether `module` (a full module name) is in modules_to_not_convert: named
        exactly, or one of its parents or its last components are."""
        return any(module == m or module.startswith(m + ".") or module.endswith("." + m)
                   for m in self.not_convert)


def fp8_format(hf: dict[str, Any]) -> Fp8Format | None:
    """The checkpoint's FP8 format, None when unquantized; ValueError naming the field of
    a quantization config this loader does not take."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported: only 'fp8' "
                         "(fine-grained FP8, e4m3 weights with block scales)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported: only 'e4m3'")
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported: only "
                         "'dynamic' (static activation scales are not read)")
    size = q.get("weight_block_size")
    if (not isinstance(size, list | tuple) or len(size) != 2 or size[0] != size[1]
            or not isinstance(size[0], int) or size[0] < 1):
        raise ValueError(f"quantization_config.weight_block_size={size!r} is not supported: it must be "
                         "a square block [B, B] with B >= 1 (per-tensor FP8 scales are not read)")
    not_convert = q.get("modules_to_not_convert") or []
    if not isinstance(not_convert, list) or not all(isinstance(m, str) for m in not_convert):
        raise ValueError(f"quantization_config.modules_to_not_convert={not_convert!r} must be a list "
                         "of module names")
    return Fp8Format(int(size[0]), tuple(not_convert))


def stored_dtype(file: Path, name: str) -> str:
    """The safetensors dtype tag of a tensor ("BF16", "F8_E4M3", ...)."""
    with safe_open(file, framework="flax") as f:
        return f.get_slice(name).get_dtype()


def read_fp8(file: Path, name: str) -> np.ndarray:
    """An F8_E4M3 tensor as a numpy float8_e4m3fn array. safetensors' numpy and flax
    readers have no FP8 type, so the bytes are read from the file's header offsets."""
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        info = json.loads(fh.read(n))[name]
        if info["dtype"] != FP8_STORED:
            raise ValueError(f"{name} in {file} is {info['dtype']}, not {FP8_STORED}")
        start, end = info["data_offsets"]
        fh.seek(8 + n + start)
        data = fh.read(end - start)
    return np.frombuffer(data, ml_dtypes.float8_e4m3fn).reshape(info["shape"])


@dataclass
class Fp8Plan:
    """Canonical weight name -> stored scale name, and the problems found."""

    scales: dict[str, str]
    missing: list[str]
    unexpected: list[str]
    misshaped: list[str]


Stored = tuple[str, str, tuple[int, ...]]  # (name in the files, dtype tag, shape)


def plan_fp8(fmt: Fp8Format | None, tensors: dict[str, Stored], linears: set[str],
             scale_files: dict[str, Stored]) -> Fp8Plan:
    """Decide per tensor which weights are FP8 and check their scales.

    tensors: canonical name -> how it is stored, for every mapped tensor; linears: the
    canonical names of Linear weights (torch [out, in]); scale_files: canonical name ->
    how it is stored, for every `*.weight_scale_inv` tensor in the files."""
    plan = Fp8Plan({}, [], [], [])
    used: set[str] = set()
    for name, (stored, dtype, shape) in sorted(tensors.items()):
        if dtype != FP8_STORED:
            if dtype.startswith("F8"):
                plan.misshaped.append(f"{stored} is {dtype}: only {FP8_STORED} (float8_e4m3fn) is read")
            continue
        if fmt is None:
            plan.misshaped.append(f"{stored} is {dtype} but config.json has no quantization_config")
            continue
        if name not in linears or not name.endswith(".weight"):
            plan.misshaped.append(f"{stored} is {dtype}: only Linear weights may be FP8")
            continue
        module = name.removesuffix(".weight")
        if fmt.excluded(module):
            plan.misshaped.append(f"{stored} is {dtype} but quantization_config.modules_to_not_convert "
                                  f"names {module}")
            continue
        scale = name + SCALE_SUFFIX
        if scale not in scale_files:
            plan.missing.append(stored + SCALE_SUFFIX)
            continue
        used.add(scale)
        s_stored, s_dtype, s_shape = scale_files[scale]
        want = tuple(-(-d // fmt.block) for d in shape)
        if s_dtype not in SCALE_STORED:
            plan.misshaped.append(f"{s_stored} is {s_dtype}: scales must be float32 or bfloat16")
        elif s_shape != want:
            plan.misshaped.append(f"{s_stored} {s_shape} (expected {want}: {stored} {shape} in "
                                  f"{fmt.block} x {fmt.block} blocks)")
        else:
            plan.scales[name] = s_stored
    plan.unexpected += sorted(scale_files[s][0] for s in set(scale_files) - used)
    return plan
