"""Reading Hugging Face config.json fields across transformers versions.

transformers 5.x writes `rope_parameters` {rope_theta, rope_type, partial_rotary_factor};
older hub files have top-level `rope_theta`, `partial_rotary_factor`, `rope_scaling`.
`time_step_limit` may hold `{"__float__": "Infinity"}` or a bare Infinity. Pure functions
over the parsed JSON dict.
"""

from __future__ import annotations

import math
from typing import Any


def as_float(x: Any) -> float:
    if isinstance(x, dict) and "__float__" in x:
        return float(x["__float__"])
    return float(x)


def rope_theta(hf: dict[str, Any], default: float = 10_000.0) -> float:
    params = hf.get("rope_parameters") or {}
    return as_float(params.get("rope_theta", hf.get("rope_theta", default)))


def partial_rotary_factor(hf: dict[str, Any], default: float = 1.0) -> float:
    params = hf.get("rope_parameters") or {}
    return as_float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default)))


def check_rope_type(hf: dict[str, Any]) -> None:
    """Only plain RoPE is implemented; refuse scaled variants instead of guessing."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported (only 'default')")


def time_step_limit(hf: dict[str, Any]) -> tuple[float, float]:
    raw = hf.get("time_step_limit")
    if raw is None:
        return (0.0, math.inf)
    lo, hi = (as_float(v) for v in raw)
    return (lo, hi)


def eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def special_tokens(hf: dict[str, Any]) -> dict[str, Any]:
    return {"bos_token_id": hf.get("bos_token_id"), "eos_token_ids": eos_ids(hf),
            "pad_token_id": hf.get("pad_token_id")}
