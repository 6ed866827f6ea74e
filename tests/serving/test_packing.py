"""Packed parameters: the pytree comes back exactly; no buffer grows past its limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from serving.runner.packing import pack, plan_layout, unpack


def tree():
    rng = np.random.default_rng(0)
    return {
        "a": jnp.asarray(rng.normal(size=(3, 50)), jnp.float32),
        "big": jnp.asarray(rng.normal(size=(1000,)), jnp.bfloat16),  # larger than a buffer
        "b": [jnp.asarray(rng.normal(size=(7,)), jnp.bfloat16) for _ in range(5)],
        "c": jnp.asarray(rng.normal(size=(2, 2, 40)), jnp.float32),
        "s": jnp.asarray(3.0, jnp.float32),
    }


def test_round_trip_and_buffer_limit():
    t = tree()
    layout = plan_layout(t, max_elements=300)
    _, bufs = pack(t, layout)
    back = jax.jit(lambda b: unpack(layout, b))(bufs)
    for x, y in zip(jax.tree.leaves(t), jax.tree.leaves(back), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert [b.dtype.name for b in bufs] == list(layout.dtypes)
    for i, b in enumerate(bufs):
        members = [shape for (bi, _, shape) in layout.leaves if bi == i]
        assert b.size == layout.sizes[i]
        # Over the limit only when the buffer holds one oversized leaf.
        assert b.size <= 300 or (len(members) == 1 and int(np.prod(members[0])) > 300)
    assert len(bufs) > len(set(layout.dtypes))  # the limit split some dtype


def test_default_limit_keeps_small_models_in_one_buffer_per_dtype():
    layout = plan_layout(tree())
    assert sorted(layout.dtypes) == ["bfloat16", "float32"]


def test_own_buffers_hold_their_leaf_alone_and_exactly():
    """Leaves `own` picks (the stream GEMM's stacks, read whole by a custom call) get a
    buffer each, exactly their size, whatever their size; the others pack as without."""
    t = tree()
    t["stack"] = jnp.asarray(np.random.default_rng(1).normal(size=(3, 5, 7)), jnp.bfloat16)  # 105 elements
    t["tail"] = jnp.asarray(np.arange(9.0), jnp.bfloat16)  # after the stack: must not join its buffer
    own = lambda x: x.ndim == 3 and x.shape == (3, 5, 7)  # noqa: E731
    layout = plan_layout(t, own=own)
    leaves = jax.tree.leaves(t)
    (i,) = [j for j, x in enumerate(leaves) if own(x)]
    b, off, shape = layout.leaves[i]
    assert (off, shape, layout.sizes[b], layout.dtypes[b]) == (0, (3, 5, 7), 105, "bfloat16")
    assert [j for j, (bj, *_) in enumerate(layout.leaves) if bj == b] == [i]
    # Without `own` the stack shares its dtype's buffer with the other bf16 leaves.
    plain = plan_layout(t)
    assert sum(bj == plain.leaves[i][0] for bj, *_ in plain.leaves) > 1
    assert len(layout.dtypes) == len(plain.dtypes) + 1
    _, bufs = pack(t, own=own)
    # The own buffer is the leaf itself (its shape, its device buffer): never copied, so the
    # largest arrays (expert stacks) are not held twice while an engine starts.
    assert bufs[b].shape == (3, 5, 7)
    assert bufs[b].unsafe_buffer_pointer() == leaves[i].unsafe_buffer_pointer()
    assert all(x.ndim == 1 for j, x in enumerate(bufs) if j != b)
    back = jax.jit(lambda bs: unpack(layout, bs))(bufs)
    for x, y in zip(leaves, jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
