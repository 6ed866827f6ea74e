"""offset_indices: every output equals its array plus its constant (numpy), any shapes, one launch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offset_indices

KERNEL_IMPL = "pallas" if jax.default_backend() == "gpu" else "interpret"


@pytest.mark.parametrize("impl", [KERNEL_IMPL, "reference"])
def test_each_output_is_its_array_plus_its_offset(impl):
    rng = np.random.default_rng(0)
    shapes = [(1,), (7,), (64, 129), (2100,), (0,), (5,)]
    xs = [rng.integers(0, 5000, s).astype(np.int32) for s in shapes]
    offsets = [(3, 1 << 24, 0), (12000 * 23,), (5, 7), (1, 2, 3, 4), (9,), ()]
    got = offset_indices(tuple(jnp.asarray(x) for x in xs), tuple(offsets), impl=impl)
    assert [len(g) for g in got] == [len(o) for o in offsets]
    for x, offs, outs in zip(xs, offsets, got, strict=True):
        for o, g in zip(offs, outs, strict=True):
            assert g.shape == x.shape and g.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(g), x.astype(np.int64) + o)


def test_bad_input_is_refused():
    z = jnp.zeros(4, jnp.int32)
    assert offset_indices((), ()) == ()
    with pytest.raises(ValueError, match="int32"):
        offset_indices((jnp.zeros(4, jnp.float32),), ((1,),))
    with pytest.raises(ValueError, match="offsets"):
        offset_indices((z,), ((1 << 31,),))
    with pytest.raises(ValueError, match="offset lists"):
        offset_indices((z, z), ((1,),))
