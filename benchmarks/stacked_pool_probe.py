"""Do paged decode and the Mamba2 state update slow down on stacked pools?

Stacked cache pools (one array per kind for all layers, each layer reading its row)
cut the decode step's 96 per-layer cache arguments, ~0.28 ms of host enqueue per step
(`arg_count_probe.py`); the engine has held its caches so since the fourteenth pass
(hybrid_jax/cache.py), and this probe was the check made before. They make the arrays
large: Pallas's Triton lowering then switches to 64-bit offsets (arrays over 4 GB), and
every layer's pages and slots lie in one allocation. This probe measures what that does
to the two kernels that stream the caches, with native-1b-parallel's shapes, in a jitted
chain of L layers:

  separate  per layer: K and V pools [4, P, 16, 128] bf16, SSM state [S, 32, 64, 128] f32
  stacked   K and V [4, L * P, 16, 128], state [L * S, 32, 64, 128]: layer l's page table
            offset by l * P and its slot ids by l * S (prepared outside the chain)

`paged_attention_decode` (B sequences at context C, no window clipping) and
`ssm_decode_packed` (B rows, the state updated in place) per layer. It prints each
variant's GPU time per chain for the two kernel families (a jax.profiler trace), the
pool sizes, and whether each crosses 4 GB.

  PYTHONPATH=. python benchmarks/stacked_pool_probe.py [--batch 64] [--slots 257]
      [--pages-per-layer 12000] [--context 600] [--layers 24]
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.step_anatomy import trace_kernels
from pallas_kernels import paged_attention_decode, ssm_decode_packed

HEADS, KV_HEADS, E, PAGE = 16, 4, 128, 16
H, HP, N, G = 32, 64, 128, 1
CONV = H * HP + 2 * G * N


def _inputs(a, rng):
    b, s = a.batch, PAGE
    width = -(-a.context // s) + 1
    if b * width + 1 > a.pages_per_layer:
        raise ValueError(f"--pages-per-layer {a.pages_per_layer} < {b * width + 1} pages in use")
    table = (1 + np.arange(b * width, dtype=np.int32)).reshape(b, width)
    slots = rng.permutation(np.arange(1, a.slots))[:b].astype(np.int32)
    q = jnp.asarray(rng.standard_normal((b, HEADS, E)), jnp.bfloat16)
    xbc = jnp.asarray(rng.standard_normal((b, CONV)), jnp.bfloat16)
    zdt = jnp.asarray(rng.standard_normal((b, H)), jnp.bfloat16)
    vec = lambda: jnp.asarray(rng.standard_normal(H), jnp.float32)  # noqa: E731
    lengths = jnp.full((b,), a.context, jnp.int32)
    return table, slots, q, xbc, zdt, (vec(), vec(), vec()), lengths


def _chain(layers: int, stacked: bool):
    def step(k, v, st, tables, slot_ids, q, xbc, zdt, vecs, lengths):
        A_log, D, dt_bias = vecs
        acc = jnp.zeros(q.shape, jnp.float32)
        yacc = jnp.zeros((q.shape[0], H, HP), jnp.float32)
        st = list(st)
        for layer in range(layers):
            kl, vl = (k, v) if stacked else (k[layer], v[layer])
            o = paged_attention_decode(q, kl, vl, lengths, tables[layer])
            acc = acc + o.astype(jnp.float32)
            i = 0 if stacked else layer
            y, st[i] = ssm_decode_packed(xbc, zdt, A_log, D, dt_bias, st[i], slot_ids[layer],
                                         num_heads=H, head_dim=HP, n_groups=G, dt_col0=0)
            yacc = yacc + y.astype(jnp.float32)
        return tuple(st), acc, yacc
    return jax.jit(step, donate_argnums=(2,))


def run(a, stacked: bool) -> dict:
    rng = np.random.default_rng(0)
    table, slots, q, xbc, zdt, vecs, lengths = _inputs(a, rng)
    L, P, S = a.layers, a.pages_per_layer, a.slots
    if stacked:
        k, v = _pool(L * P, 0, 0.37), _pool(L * P, 0, 0.53)
        st = (_state(L * S, 0),)
        tables = [jnp.asarray(table + layer * P) for layer in range(L)]
        slot_ids = [jnp.asarray(slots + layer * S) for layer in range(L)]
    else:  # layer l's arrays hold what the stacked ones hold at its row
        k = tuple(_pool(P, layer * P, 0.37) for layer in range(L))
        v = tuple(_pool(P, layer * P, 0.53) for layer in range(L))
        st = tuple(_state(S, layer * S) for layer in range(L))
        tables = [jnp.asarray(table)] * L
        slot_ids = [jnp.asarray(slots)] * L
    fn = _chain(L, stacked)
    box = {"st": st}

    def call():
        box["st"], acc, yacc = fn(k, v, box["st"], tables, slot_ids, q, xbc, zdt, vecs, lengths)
        return acc, yacc

    first = jax.device_get(call())  # the same inputs and cache contents in both variants

    kernel_ms, kernels, top, _ = trace_kernels(call, 10, 0)
    fam = {"paged_decode": 0.0, "ssm_decode": 0.0}
    for name, ms, _ in top:
        for f in fam:
            if f in name:
                fam[f] += ms
    kv_bytes = 2 * (k.nbytes if stacked else sum(x.nbytes for x in k))
    big = lambda x: x.nbytes > 2 ** 32  # noqa: E731
    return {"variant": "stacked" if stacked else "separate", "batch": a.batch, "context": a.context,
            "layers": L, "kv_pool_gb": kv_bytes / 2 ** 30, "state_gb": sum(x.nbytes for x in st) / 2 ** 30,
            "kv_array_over_4gb": big(k if stacked else k[0]), "state_array_over_4gb": big(st[0]),
            "paged_decode_ms": fam["paged_decode"], "ssm_decode_ms": fam["ssm_decode"],
            "kernel_ms": kernel_ms, "kernels": kernels, "device": str(jax.devices()[0])}, first


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _wave(shape: tuple[int, ...], axis: int, first: int, coeffs: tuple[float, ...]) -> jax.Array:
    """f32 sin(sum_d i_d * coeffs[d]) over the array's indices, index `axis` counted from
    `first` (its place in the stacked pool): a layer's array and the stack's row hold the
    same values. Iotas per axis: no 32-bit overflow in arrays over 2**31 elements."""
    acc = jnp.zeros(shape, jnp.float32)
    for d, c in enumerate(coeffs):
        i = jax.lax.broadcasted_iota(jnp.int32, shape, d).astype(jnp.float32)
        acc = acc + ((i + first) if d == axis else i) * c
    return jnp.sin(acc)


def _pool(pages: int, first: int, f: float) -> jax.Array:
    """K or V pages [4, pages, 16, 128] bf16, the pages counted from `first`."""
    return _wave((KV_HEADS, pages, PAGE, E), 1, first, (0.7, f, 0.11, 0.013)).astype(jnp.bfloat16)


def _state(slots: int, first: int) -> jax.Array:
    """SSM states [slots, 32, 64, 128] f32, the slots counted from `first`."""
    return 0.1 * _wave((slots, H, HP, N), 0, first, (0.13, 0.7, 0.05, 0.011))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=64, help="decode rows per layer")
    p.add_argument("--slots", type=int, default=257, help="state slots per layer (stack: x layers)")
    p.add_argument("--pages-per-layer", type=int, default=12000, help="K/V pages per layer")
    p.add_argument("--context", type=int, default=600, help="tokens in cache per sequence")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2, help="separate / stacked pairs run")
    a = p.parse_args()
    for _ in range(a.rounds):
        outs = []
        for stacked in (False, True):
            row, first = run(a, stacked)
            outs.append(first)
            print(json.dumps(row), flush=True)
        # The chains read the same values: the stacked offsets address the right rows.
        err = max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                  for x, y in zip(*outs, strict=True))
        print(json.dumps({"max_abs_diff_separate_vs_stacked": err}), flush=True)
        if err > 1e-3:
            raise SystemExit(f"stacked and separate chains differ by {err}")


if __name__ == "__main__":
    main()
