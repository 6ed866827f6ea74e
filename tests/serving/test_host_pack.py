"""One int32 host buffer per step: what goes in comes out, bit for bit."""

import jax
import numpy as np
import pytest

from serving.host_pack import host_layout


def test_round_trip_every_dtype_and_shape():
    rng = np.random.default_rng(0)
    tree = ({"a": rng.integers(-2**31, 2**31 - 1, (3, 5), dtype=np.int32),
             "f": rng.standard_normal(7).astype(np.float32)},
            (np.array([0, 2**32 - 1, 7], np.uint32), rng.random(4) > 0.5),
            np.array([np.nan, -0.0, np.inf], np.float32))
    layout = host_layout(tree).padded(64)
    buf = layout.pack(tree)
    assert buf.shape == (64,) and buf.dtype == np.int32
    back = jax.jit(layout.unpack)(buf)
    for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert y.dtype == x.dtype and y.shape == x.shape
        np.testing.assert_array_equal(np.asarray(y).view(np.uint8), x.view(np.uint8))


def test_prefix_layout_reads_the_leading_fields_of_a_longer_buffer():
    head = (np.arange(4, dtype=np.int32), np.ones(4, np.float32))
    full = host_layout((head, np.arange(9, dtype=np.int32)))
    prefix = host_layout(head).padded(full.size)
    back = prefix.unpack(full.pack((head, np.arange(9, dtype=np.int32))))
    np.testing.assert_array_equal(back[0], head[0])
    np.testing.assert_array_equal(back[1], head[1])


def test_refuses_what_it_cannot_carry():
    with pytest.raises(TypeError, match="int64"):
        host_layout((np.zeros(3, np.int64),))
    layout = host_layout((np.zeros(3, np.int32),))
    with pytest.raises(ValueError, match="layout has"):
        layout.pack((np.zeros(4, np.int32),))
    with pytest.raises(ValueError, match="does not fit"):
        layout.padded(2)
