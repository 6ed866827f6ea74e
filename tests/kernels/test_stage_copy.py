"""`stage_copy`: the kernel (interpret mode on CPU, compiled on a GPU) returns its input
bit for bit, whatever the length relative to its block (masked tail), and inside a jitted
step that unpacks a host buffer the unpacked fields are unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.stage_copy import BLOCK, stage_copy, write_into
from serving.runner.host_pack import host_layout

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 300])
@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint32])
def test_copy_is_bit_exact(n, dtype):
    rng = np.random.default_rng(n)
    bits = rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32)
    x = bits.view(dtype)  # any bit pattern, NaNs included for float32
    y = np.asarray(stage_copy(jnp.asarray(x), impl=KERNEL_IMPL))
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(y.view(np.int32), bits)


def test_refuses_other_shapes():
    with pytest.raises(ValueError, match="1-D array of a 4-byte dtype"):
        stage_copy(jnp.zeros((2, 3), jnp.int32), impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="1-D array of a 4-byte dtype"):
        stage_copy(jnp.zeros((8,), jnp.bfloat16), impl=KERNEL_IMPL)


def test_staged_unpack_equals_plain_unpack(monkeypatch):
    """A host layout unpacked with stage=True inside jit gives the same fields (the kernel
    runs: the reference impl would make this test vacuous)."""
    import serving.runner.host_pack as hp

    monkeypatch.setattr(hp, "stage_copy", lambda x: stage_copy(x, impl=KERNEL_IMPL))
    rng = np.random.default_rng(0)
    tree = {"a": rng.integers(-5, 5, (3, 4)).astype(np.int32), "b": rng.random(5).astype(np.float32),
            "c": rng.random(6) < 0.5}
    lay = host_layout(tree).padded(40)
    buf = jnp.asarray(lay.pack(tree))
    got = jax.jit(lambda b: lay.unpack(b, stage=True))(buf)
    want = jax.jit(lambda b: lay.unpack(b))(buf)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
        np.testing.assert_array_equal(np.asarray(got[k]), tree[k])


def test_write_into_returns_the_sources_in_the_destinations():
    """Several arrays of 4-byte dtypes (2-D, longer than a block, NaN bit patterns) written
    into donated destinations that hold other values: the results equal the sources."""
    rng = np.random.default_rng(3)
    shapes = [(8,), (5, 20), (BLOCK + 37,), (3, 3)]
    dtypes = [np.int32, np.float32, np.uint32, np.float32]
    srcs = tuple(rng.integers(-2**31, 2**31, s, dtype=np.int64).astype(np.int32).view(d)
                 for s, d in zip(shapes, dtypes, strict=True))
    dsts = tuple(jnp.asarray(np.full(s, 7, d)) for s, d in zip(shapes, dtypes, strict=True))
    f = jax.jit(lambda d, s: write_into(d, s, impl=KERNEL_IMPL), donate_argnums=(0,))
    got = f(dsts, tuple(jnp.asarray(x) for x in srcs))
    for g, x in zip(got, srcs, strict=True):
        assert g.shape == x.shape and g.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.int32), x.view(np.int32))


def test_write_into_refuses_mismatches():
    a = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match="shape and dtype"):
        write_into((a,), (jnp.zeros((5,), jnp.int32),), impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="shape and dtype"):
        write_into((a,), (jnp.zeros((4,), jnp.float32),), impl=KERNEL_IMPL)
    with pytest.raises(ValueError, match="4-byte"):
        write_into((a.astype(jnp.bfloat16),), (a.astype(jnp.bfloat16),), impl=KERNEL_IMPL)
