"""One int32 host buffer per step: what goes in comes out, bit for bit."""

import jax
import numpy as np
import pytest

from serving.runner.host_pack import host_layout


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


def test_host_put_fast_path_and_its_fallback(monkeypatch):
    """`host_put` gives a committed array with the sharding and the host values, through
    JAX's private transfer where it works here, else through jax.device_put."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from serving.runner import host_pack
    sharding = NamedSharding(Mesh(np.asarray(jax.devices()[:1]), ("tp",)), PartitionSpec())
    buf = np.arange(-5, 300, dtype=np.int32)
    put = host_pack.host_put(sharding)
    assert put.__name__ == "fast"  # the private path works with this jax
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(1) or real(*a, **k))
    for fn in (put, host_pack.host_put(sharding)):
        got = fn(buf)
        assert got.sharding == sharding and got.committed
        np.testing.assert_array_equal(np.asarray(got), buf)
    assert calls == []

    def broken(*a, **k):
        raise TypeError("signature changed")

    monkeypatch.setattr(host_pack, "_private_transfer", lambda: broken)
    fallback = host_pack.host_put(sharding)
    got = fallback(buf)
    assert fallback.__name__ == "<lambda>" and calls == [1]
    assert got.sharding == sharding and got.committed
    np.testing.assert_array_equal(np.asarray(got), buf)
    zeros = lambda *a: jax.device_put(np.zeros(7, np.int32), sharding)
    monkeypatch.setattr(host_pack, "_private_transfer", lambda: zeros)
    assert host_pack.host_put(sharding).__name__ == "<lambda>"  # wrong values: refused
