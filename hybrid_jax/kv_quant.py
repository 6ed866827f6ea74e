"""FP8 KV cache: the scales of float8_e4m3fn K/V pages (`kv_cache_dtype="fp8"`).

K/V pages are stored in e4m3 with f32 scales, one per layer and KV head (`kv_scale="head"`)
or one per layer broadcast over its heads (`kv_scale="tensor"`); the real K/V are the page
values times the scale (pallas_kernels/paged_attention.py reads and writes them). The scales
are static: a value written once is never re-scaled, and a token's pages must not depend
on which requests came before it (batched == solo, a prefix-cache hit == a miss). They are
calibrated once when the engine starts: one prefill of a fixed pseudo-random token
sequence through the model's serving path into a cache in the compute dtype, then the
largest |K| and |V| each layer (and head) wrote, times HEADROOM, is mapped to e4m3's 448.
e4m3 is a float format (3 mantissa bits at every magnitude from 2^-6 to 448 of the scale),
so headroom costs precision only for values under 2^-6 x scale, which barely contribute to
attention; values past the calibrated range clip at 448 x scale.

Knows the model's serving forward and the cache layout, nothing of the engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hybrid_jax.cache import RaggedBatch, init_caches
from hybrid_jax.model import CausalLM

KV_CACHE_DTYPES = ("auto", "fp8")
KV_SCALES = ("head", "tensor")
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = float(jnp.finfo(FP8).max)  # 448
HEADROOM = 4.0  # calibrated |x| max maps to 448 / HEADROOM: real text may exceed random tokens
CALIBRATION_TOKENS = 256
CALIBRATION_PAGE = 16


def check_kv_cache_dtype(kv_cache_dtype: str, kv_scale: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported: one of {KV_CACHE_DTYPES} "
                         "('auto': the model's dtype)")
    if kv_scale not in KV_SCALES:
        raise ValueError(f"kv_scale={kv_scale!r} is not supported: one of {KV_SCALES}")


def kv_dtype(kv_cache_dtype: str, dtype) -> jnp.dtype:
    """The pages' dtype: e4m3 for "fp8", else the compute dtype."""
    return FP8 if kv_cache_dtype == "fp8" else jnp.dtype(dtype)


def calibration_tokens(vocab_size: int, n: int = CALIBRATION_TOKENS) -> np.ndarray:
    """The fixed calibration sequence: n pseudo-random ids (seed 0)."""
    return np.random.default_rng(0).integers(0, vocab_size, n).astype(np.int32)


def calibrate_kv_scales(model: CausalLM, kv_scale: str, tokens: np.ndarray | None = None
                        ) -> tuple[tuple[np.ndarray, np.ndarray], ...]:
    """Per window group (k_scale, v_scale), each f32 [k, n_g] (module doc): one prefill of
    `tokens` (default `calibration_tokens`) into a cache in the model's dtype."""
    check_kv_cache_dtype("fp8", kv_scale)
    # Where the parameters live: tensor parallelism loads the whole model on the host CPU,
    # and the prefill must not pull it onto one accelerator.
    device = next(iter(jax.tree.leaves(nnx.state(model))[0].devices()))
    with jax.default_device(device):
        return _calibrate(model, kv_scale, tokens)


def _calibrate(model: CausalLM, kv_scale: str, tokens: np.ndarray | None):
    cfg = model.cfg
    ids = calibration_tokens(cfg.vocab_size) if tokens is None else np.asarray(tokens, np.int32)
    n, s = len(ids), CALIBRATION_PAGE
    pages = -(-n // s)
    groups = len(cfg.windows)
    caches = init_caches(cfg, num_pages=(pages + 1,) * groups, page_size=s, num_slots=2,
                         dtype=model.dtype)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    batch = RaggedBatch(
        tokens=i32(ids), positions=i32(np.arange(n)), cu_seqlens=i32([0, n]), lengths=i32([n]),
        slot_ids=i32([1]), has_initial=jnp.asarray([False]),
        page_tables=(i32(np.arange(1, pages + 1)[None]),) * groups,  # page 0: the dummy
        slot_mappings=(i32(s + np.arange(n)),) * groups, last_token=i32([n - 1]))
    graphdef, state = nnx.split(model)
    out = _prefill(graphdef)(state, batch, caches)
    scales = []
    for kv in out.kv:
        pair = []
        for x in (kv.k, kv.v):  # [k, n_g, P, s, e]; page 0 is the dummy
            amax = np.asarray(jnp.max(jnp.abs(x[:, :, 1:].astype(jnp.float32)), axis=(2, 3, 4)))
            if kv_scale == "tensor":
                amax = np.broadcast_to(amax.max(axis=0, keepdims=True), amax.shape)
            pair.append(np.where(amax > 0, amax * HEADROOM / FP8_MAX, 1.0).astype(np.float32))
        scales.append(tuple(pair))
    return tuple(scales)


@functools.lru_cache(maxsize=4)
def _prefill(graphdef):
    """The calibration prefill, compiled once per model graph (engines of one model share it)."""
    from hybrid_jax.ragged import forward_ragged  # imports the layers; kept off this module's import

    return jax.jit(lambda st, b, c: forward_ragged(nnx.merge(graphdef, st), b, c, decode=False)[1])


def with_kv_scales(caches, scales: tuple[tuple[np.ndarray, np.ndarray], ...]):
    """FP8 cache stacks with their scales set (`calibrate_kv_scales`' form), each placed like
    the ones it replaces."""
    kv = tuple(c._replace(k_scale=jax.device_put(jnp.asarray(ks), c.k_scale.sharding),
                          v_scale=jax.device_put(jnp.asarray(vs), c.v_scale.sharding))
               for c, (ks, vs) in zip(caches.kv, scales, strict=True))
    return caches._replace(kv=kv)
