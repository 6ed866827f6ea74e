"""offset_indices: every output equals x plus its constant (numpy), any shape, one launch."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import offset_indices


@pytest.mark.parametrize("impl", ["interpret", "reference"])
@pytest.mark.parametrize("shape", [(1,), (7,), (64, 129), (2100,)])
def test_each_output_is_x_plus_its_offset(impl, shape):
    x = np.random.default_rng(len(shape)).integers(0, 5000, shape).astype(np.int32)
    offsets = (3, 1 << 24, 0, 12000 * 23)
    got = offset_indices(jnp.asarray(x), offsets, impl=impl)
    assert len(got) == len(offsets)
    for g, o in zip(got, offsets, strict=True):
        assert g.shape == x.shape and g.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(g), x.astype(np.int64) + o)


def test_no_offsets_and_bad_input():
    assert offset_indices(jnp.zeros(4, jnp.int32), ()) == ()
    with pytest.raises(ValueError, match="int32"):
        offset_indices(jnp.zeros(4, jnp.float32), (1,))
    with pytest.raises(ValueError, match="offsets"):
        offset_indices(jnp.zeros(4, jnp.int32), (1 << 31,))
