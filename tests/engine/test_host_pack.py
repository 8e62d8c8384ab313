"""host_pack: a pytree's host arrays travel as one buffer and come back unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.engine.host_pack import pack, unpack


def _tree(rng: np.random.Generator) -> dict:
    return {"ids": rng.integers(-5, 1000, size=(3, 7)).astype(np.int32),
            "p": rng.random(5).astype(np.float32),
            "seed": rng.integers(0, 2**32, size=(4, 2), dtype=np.uint64).astype(np.uint32),
            "on_device": jnp.arange(6, dtype=jnp.int32),
            "absent": None,
            "empty": np.zeros((0, 4), np.int32)}


def test_round_trip_inside_jit_keeps_values_dtypes_and_device_leaves():
    tree = _tree(np.random.default_rng(7))
    packed = pack(tree)
    host_leaves = [x for x in jax.tree.leaves(packed) if not isinstance(x, jax.Array)]
    assert len(host_leaves) == 1 and host_leaves[0].dtype == np.int32  # one transfer
    out = jax.jit(unpack)(packed)
    assert out["absent"] is None
    for name in ("ids", "p", "seed", "on_device", "empty"):
        assert out[name].dtype == tree[name].dtype and out[name].shape == tree[name].shape
        np.testing.assert_array_equal(np.asarray(out[name]), np.asarray(tree[name]))


def test_layouts_key_their_own_traces():
    """Same total size, different split: the layout is static, so the two do not collide."""
    traces = []

    @jax.jit
    def first(p):
        traces.append(1)
        return unpack(p)["a"]

    a = pack({"a": np.arange(4, dtype=np.int32), "b": np.arange(2, dtype=np.int32)})
    b = pack({"a": np.arange(2, dtype=np.int32), "b": np.arange(4, dtype=np.int32)})
    assert first(a).shape == (4,) and first(b).shape == (2,) and len(traces) == 2


def test_eight_byte_host_arrays_are_refused():
    with pytest.raises(TypeError, match="4-byte host arrays, got int64"):
        pack({"x": np.arange(3, dtype=np.int64)})
