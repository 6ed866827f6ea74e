"""`horizontal.launch_parts`: toy kernels launched alone and side by side give what numpy
gives: every program of every part runs once with its own ids, blocked operands are read
and written at the blocks of those ids, whole ones in place, aliases hold.

Interpret mode on CPU; the lowering of two parts to one Triton call is checked too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.horizontal import Block, Part, launch_parts

IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _blocked_part(x: jax.Array) -> Part:
    """Grid (3, 2) over x [3, 2, 8]: block (i, j) <- 2 * x[i, j] + 10 * i + j (the ids)."""

    def body(x_ref, o_ref, *, pids):
        i, j = pids
        o_ref[...] = 2 * x_ref[...] + (10 * i + j).astype(jnp.float32)

    blk = Block((None, None, 8), lambda i, j: (i, j, 0))
    return Part(body, (3, 2), (x,), (blk,), (jax.ShapeDtypeStruct(x.shape, x.dtype),), (blk,), {})


def _whole_part(v: jax.Array, n: int) -> Part:
    """Grid (n,) over a whole v [n, 16], updated in place: row i += i + 1, read from the
    aliased output, so a program that ran twice (or a row another program wrote) shows."""

    def body(v_ref, o_ref, *, pids):
        (i,) = pids
        o_ref[i, :] = o_ref[i, :] + (i + 1).astype(jnp.float32)

    return Part(body, (n,), (v,), (None,), (jax.ShapeDtypeStruct(v.shape, v.dtype),), (None,), {0: 0})


def _want(x, v):
    ids = 10 * np.arange(3)[:, None, None] + np.arange(2)[None, :, None]
    return 2 * np.asarray(x) + ids, np.asarray(v) + (np.arange(v.shape[0]) + 1)[:, None]


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32),
            jnp.asarray(rng.standard_normal((5, 16)), jnp.float32))


def test_alone_and_together_match_numpy(arrays):
    x, v = arrays
    want_x, want_v = _want(x, v)
    run = functools.partial(launch_parts, impl=IMPL, num_warps=4, num_stages=1, name="toy")
    (alone_x,) = run((_blocked_part(x),))
    (alone_v,) = run((_whole_part(v, 5),))
    np.testing.assert_allclose(alone_x, want_x, rtol=1e-6)
    np.testing.assert_allclose(alone_v, want_v, rtol=1e-6)
    for parts, order in (((_blocked_part(x), _whole_part(v, 5)), (0, 1)),
                         ((_whole_part(v, 5), _blocked_part(x)), (1, 0))):
        out = run(parts)
        got = dict(zip(order, out, strict=True))
        np.testing.assert_allclose(got[0], want_x, rtol=1e-6)
        np.testing.assert_allclose(got[1], want_v, rtol=1e-6)


def test_aliases_update_in_place(arrays):
    x, v = arrays
    v = jnp.array(v)
    ptr = v.unsafe_buffer_pointer()
    step = jax.jit(lambda x, v: launch_parts((_blocked_part(x), _whole_part(v, 5)), impl=IMPL,
                                             num_warps=4, num_stages=1, name="toy"), donate_argnums=1)
    _, out_v = step(x, v)
    assert out_v.unsafe_buffer_pointer() == ptr


def test_two_parts_lower_to_one_triton_call(arrays):
    pytest.importorskip("jax._src.lib.triton")
    x, v = arrays
    f = jax.jit(lambda x, v: launch_parts((_blocked_part(x), _whole_part(v, 5)), impl="pallas",
                                          num_warps=4, num_stages=1, name="toy"))
    text = f.trace(x, v).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
