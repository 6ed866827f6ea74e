"""Every `HYBRID_JAX_*` environment variable, read here and nowhere else.

Why here: `configs` is the bottom of the dependency graph. It holds plain data (model
presets, engine settings) and imports nothing of `pallas_kernels`, `hybrid_jax` or
`serving`, and not jax either; this module imports only the standard library. So the
kernels, the model package, the engine and the CLI (which must start without importing
jax) can all read their switches here without an import pointing upwards.
`pallas_kernels/` would not do: its package imports every kernel, and jax with them.
This module knows nothing of what the switches do; each reader applies its own.

`SWITCHES` lists them with their defaults and a one-line meaning; docs/switches.md is
the same table (`tests/test_switches.py` checks that the two agree and that no other
module reads a `HYBRID_JAX_*` variable). Each accessor reads the environment when
called: the model's module-level constants (hybrid_jax/ragged.py, layers/linear.py)
call theirs at import, the engine its own at start-up.

Switches whose alternative was measured and rejected are gone with their code paths
(docs/history/benchmarks-2026.md keeps the figures that rejected them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Switch:
    name: str
    default: str  # as the variable would spell it; "unset" where unset means something
    meaning: str


SWITCHES: tuple[Switch, ...] = (
    Switch("HYBRID_JAX_KERNELS", "unset",
           "kernel implementation: pallas, interpret or reference (unset: pallas on a GPU, "
           "reference elsewhere)"),
    Switch("HYBRID_JAX_FUSE_PROJECTIONS", "1",
           "0 serves the model unfused (one GEMM per projection instead of one per shared input)"),
    Switch("HYBRID_JAX_DECODE_GLUE", "1",
           "0 runs the decode step's glue (split merge, gated norm, residual add + norm) as XLA "
           "ops instead of the Pallas `mixer_merge` / `add_rms_norm` launches"),
    Switch("HYBRID_JAX_SPLIT_K", "1",
           "0 runs decode out/down projections as one GEMM instead of two depth halves summed "
           "by `add_rms_norm`"),
    Switch("HYBRID_JAX_PARALLEL_DECODE_ROWS", "128",
           "decode steps of at most this many rows launch paged decode and the Mamba2 state "
           "update as one grid (0: apart)"),
    Switch("HYBRID_JAX_FOLD_CONV_ROWS", "8",
           "decode steps of at most this many rows run the Mamba2 conv inside the state "
           "update (0: its own launch)"),
    Switch("HYBRID_JAX_MIXED_DECODE_UPDATE", "1",
           "0 runs a mixed step's one-token sequences (its decodes) through the chunked Mamba2 "
           "scan with the prompts instead of the decode update"),
    Switch("HYBRID_JAX_STREAM_GEMM", "1",
           "0 runs a gated MLP's decode gate/up on cuBLAS and silu * up in XLA instead of one "
           "Mosaic GPU `stream_glu` launch (Hopper, 8-64 rows)"),
    Switch("HYBRID_JAX_STREAM_GEMM_CONFIG", "unset",
           "tn,tk,stages,swap: overrides `stream_glu`'s launch (tuning on another GPU)"),
    Switch("HYBRID_JAX_MOE_FEW_CONFIG", "unset",
           "bn,bk,warps,stages,splits: overrides the grouped GEMM's tiles for at most 16 "
           "(token, expert) rows (MoE decode at batch 1-2; tuning on another GPU)"),
    Switch("HYBRID_JAX_FP8_GEMV", "1",
           "0 runs FP8 Linears' decode products (<= 64 rows) through the dequantize path "
           "instead of the Pallas FP8 decode kernels (`fp8_stream` on Hopper for [out, in] "
           "kernels, else `fp8_gemv`)"),
    Switch("HYBRID_JAX_FP8_REDUCE", "1",
           "0 takes one-row FP8 products of [out, in] kernels on a GPU through the FP8 decode "
           "kernels instead of XLA's row reduction over the e4m3 weight"),
    Switch("HYBRID_JAX_FP8_GEMM", "0",
           "1 runs FP8 Linears' prefill products (> 64 rows, [out, in] kernels, 128 x 128 blocks) "
           "through the Mosaic GPU block-scaled FP8 GEMM (activations quantized per token and "
           "128-wide group) on Hopper, instead of the dequantized weight through XLA's bf16 GEMM"),
    Switch("HYBRID_JAX_MLA_KERNEL", "0",
           "1 runs MLA's latent decode (and verification) attention through the Pallas "
           "`mla_decode` kernel where the Pallas backend is used, instead of the XLA paged "
           "reference (off until the kernel beats the reference at every batch: on an H100 it wins at "
           "batch 16, loses at batch 1; docs/benchmarks.md)"),
    Switch("HYBRID_JAX_KDA_KERNEL", "1",
           "0 runs KDA's prefill (the gated delta rule with a per-channel decay) as the pure-JAX "
           "chunked form instead of the Pallas `kda_prefill` pipeline where the Pallas backend "
           "is used (H100: the pipeline is 3.4-4.0x faster)"),
    Switch("HYBRID_JAX_XLA_OPTIONS", "unset",
           "JSON object of XLA compile options added to, or overriding, the step executables' own"),
    Switch("HYBRID_JAX_SHARDED_RUNNER", "0",
           "1 runs the tensor-parallel code path on a one-device mesh (checks the TP step on "
           "one GPU)"),
    Switch("HYBRID_JAX_EXECUTABLE_STORE", "unset",
           "0 turns the serialized-executable store off, 1 on for any backend (unset: on GPUs, "
           "when a compilation cache directory is set)"),
    Switch("HYBRID_JAX_EXECUTABLE_STORE_MAX_GB", "8",
           "disk budget of the executable store; least recently used executables go first"),
    Switch("HYBRID_JAX_PROFILE_DEVICE", "unset",
           "1: `serve --profile-dir` records a jax.profiler trace on GPUs too (unset: step log only "
           "there; a CUPTI trace of a running engine poisoned the CUDA context, jax-ml/jax#40260)"),
    Switch("HYBRID_JAX_API_KEY", "unset",
           "default of `--api-key` (server and client): calls need `authorization: Bearer KEY`"),
    Switch("HYBRID_JAX_DEBUG", "unset",
           "set (non-empty): the CLI prints the traceback of a usage error"),
)

# Names that never key the executable store: secrets, debugging, the store's own switches.
_NOT_KEYED = ("KEY", "SECRET", "TOKEN", "PASSWORD", "DEBUG", "EXECUTABLE_STORE", "PROFILE")


def _get(name: str) -> str | None:
    return os.environ.get(name)


def _on(name: str) -> bool:
    """A default-on switch: anything but "0" keeps it on."""
    return _get(name) != "0"


def _rows(name: str, default: int) -> int:
    text = _get(name)
    if text is None:
        return default
    try:
        rows = int(text)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"{name}={text!r} must be an integer >= 0")
    return rows


def kernels() -> str | None:
    """HYBRID_JAX_KERNELS, unvalidated (pallas_kernels.backend checks it)."""
    return _get("HYBRID_JAX_KERNELS")


def fuse_projections() -> bool:
    text = _get("HYBRID_JAX_FUSE_PROJECTIONS")
    text = "1" if text is None else text
    if text not in ("0", "1"):
        raise ValueError(f"HYBRID_JAX_FUSE_PROJECTIONS={text!r} must be 0 or 1")
    return text == "1"


def decode_glue() -> bool:
    return _on("HYBRID_JAX_DECODE_GLUE")


def split_k() -> bool:
    return _on("HYBRID_JAX_SPLIT_K")


def parallel_decode_rows() -> int:
    return _rows("HYBRID_JAX_PARALLEL_DECODE_ROWS", 128)


def fold_conv_rows() -> int:
    return _rows("HYBRID_JAX_FOLD_CONV_ROWS", 8)


def mixed_decode_update() -> bool:
    return _on("HYBRID_JAX_MIXED_DECODE_UPDATE")


def stream_gemm() -> bool:
    return _on("HYBRID_JAX_STREAM_GEMM")


def fp8_gemv() -> bool:
    return _on("HYBRID_JAX_FP8_GEMV")


def fp8_reduce() -> bool:
    return _on("HYBRID_JAX_FP8_REDUCE")


def fp8_gemm() -> bool:
    """Default off: on an H100 the prefill step with it is 1.01x bf16's (0.98x without), and it
    quantizes the activations of steps over 64 rows only (docs/kernels.md "FP8")."""
    return (_get("HYBRID_JAX_FP8_GEMM") or "0") == "1"


def mla_kernel() -> bool:
    """Default off: on an H100 the kernel loses to the reference at batch 1 (docs/benchmarks.md)."""
    return (_get("HYBRID_JAX_MLA_KERNEL") or "0") == "1"


def kda_kernel() -> bool:
    """Default on: on an H100 the kernel is 3.4-4.0x faster than the chunked form and as close
    to it as fla's (docs/benchmarks.md)."""
    return _on("HYBRID_JAX_KDA_KERNEL")


def stream_gemm_config() -> tuple[int, int, int, int] | None:
    """(tn, tk, stages, swap) from HYBRID_JAX_STREAM_GEMM_CONFIG, None if unset."""
    text = _get("HYBRID_JAX_STREAM_GEMM_CONFIG")
    if not text:
        return None
    try:
        tn, tk, stages, swap = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"HYBRID_JAX_STREAM_GEMM_CONFIG={text!r}: expected four integers "
                         "tn,tk,stages,swap") from None
    return tn, tk, stages, swap


def xla_options() -> dict[str, object]:
    """HYBRID_JAX_XLA_OPTIONS as a dict ({} if unset)."""
    text = _get("HYBRID_JAX_XLA_OPTIONS")
    return json.loads(text) if text else {}


def sharded_runner() -> bool:
    return (_get("HYBRID_JAX_SHARDED_RUNNER") or "0") == "1"


def executable_store() -> str | None:
    """HYBRID_JAX_EXECUTABLE_STORE as set ("0", "1") or None."""
    return _get("HYBRID_JAX_EXECUTABLE_STORE")


def profile_device() -> bool:
    """HYBRID_JAX_PROFILE_DEVICE == "1"."""
    return _get("HYBRID_JAX_PROFILE_DEVICE") == "1"


def executable_store_max_bytes(default: int) -> int:
    gb = _get("HYBRID_JAX_EXECUTABLE_STORE_MAX_GB")
    return int(float(gb) * 2**30) if gb else default


def api_key() -> str | None:
    return _get("HYBRID_JAX_API_KEY")


def debug() -> bool:
    return bool(_get("HYBRID_JAX_DEBUG"))


def keyed_environment() -> list[tuple[str, str]]:
    """The HYBRID_JAX_* variables set in this process that change what the engine compiles
    (all but secrets, debugging and the store's own switches), sorted: part of the
    executable store's key, so an unknown name set for an experiment keys apart too."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith("HYBRID_JAX_") and _keyed(k))


# The switches above that do not change what the engine compiles. Names in SWITCHES are
# judged by this list alone: a word rule would drop a compile switch whose name happens to
# hold one of the words (HYBRID_JAX_SINGLE_TOKEN_ROWS once did, and the store served its
# other value's executables).
_NOT_KEYED_SWITCHES = frozenset({"HYBRID_JAX_EXECUTABLE_STORE", "HYBRID_JAX_EXECUTABLE_STORE_MAX_GB",
                                 "HYBRID_JAX_PROFILE_DEVICE", "HYBRID_JAX_API_KEY", "HYBRID_JAX_DEBUG"})


def _keyed(name: str) -> bool:
    """Known switches: all but `_NOT_KEYED_SWITCHES`; unknown names (experiments): all but
    those that look like secrets or debugging (`_NOT_KEYED` words)."""
    if name in {s.name for s in SWITCHES}:
        return name not in _NOT_KEYED_SWITCHES
    return not any(w in name for w in _NOT_KEYED)


def moe_few_config() -> tuple[int, int, int, int, int] | None:
    """(bn, bk, warps, stages, splits) from HYBRID_JAX_MOE_FEW_CONFIG, None if unset."""
    text = _get("HYBRID_JAX_MOE_FEW_CONFIG")
    if not text:
        return None
    try:
        bn, bk, warps, stages, splits = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"HYBRID_JAX_MOE_FEW_CONFIG={text!r}: expected five integers "
                         "bn,bk,warps,stages,splits") from None
    return bn, bk, warps, stages, splits
