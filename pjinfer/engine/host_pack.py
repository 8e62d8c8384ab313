"""A step's host arrays as one buffer: one host-to-device copy per executable call.

Every NumPy argument of a jitted call is its own host-to-device copy, and on the H200's host
each cost ~33 us of the launching thread's time (RESULTS.md, round 5; measured on a trivial
call, `benchmarks/host_launch.py`): the model step passes ten such arrays and the sampler
fifteen. `pack` lays a pytree's host leaves (4-byte dtypes) end to end in one int32 buffer and
keeps its device leaves as they are; `unpack`, traced inside the executable, slices the
arrays back out (static offsets: free for XLA). The layout is the pytree's static part, so
each distinct layout keys its own trace, as the shapes it encodes would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

# One entry per leaf: ("host", offset, shape, dtype) or ("device", index into `device`).
LeafSpec = tuple


@dataclass(frozen=True)
class Packed:
    """A pytree's leaves, host ones packed: `words` [n] int32, `device` the device arrays."""

    words: Any  # [n] int32 (NumPy on the host, a device array once traced)
    device: tuple
    treedef: Any
    specs: tuple[LeafSpec, ...]


jax.tree_util.register_pytree_node(
    Packed,
    lambda p: ((p.words, *p.device), (p.treedef, p.specs)),
    lambda aux, children: Packed(children[0], tuple(children[1:]), *aux),
)


def pack(tree: Any) -> Packed:
    """Pack `tree`'s NumPy leaves (int32, uint32, float32) into one buffer."""
    leaves, treedef = jax.tree.flatten(tree)
    words, device, specs, offset = [], [], [], 0
    for leaf in leaves:
        if type(leaf) is not np.ndarray:  # cheaper than isinstance(leaf, jax.Array) first
            if isinstance(leaf, jax.Array):
                specs.append(("device", len(device)))
                device.append(leaf)
                continue
            leaf = np.asarray(leaf)
        if leaf.itemsize != 4:
            raise TypeError(f"pack takes 4-byte host arrays, got {leaf.dtype} {leaf.shape}")
        specs.append(("host", offset, leaf.shape, leaf.dtype))
        words.append(leaf.reshape(-1).view(np.int32))
        offset += leaf.size
    buffer = np.concatenate(words) if words else np.zeros(0, np.int32)
    return Packed(buffer, tuple(device), treedef, tuple(specs))


def unpack(packed: Packed) -> Any:
    """The pytree `pack` was given, its host leaves sliced out of `words` (traceable)."""
    leaves = []
    for spec in packed.specs:
        if spec[0] == "device":
            leaves.append(packed.device[spec[1]])
            continue
        _, offset, shape, dtype = spec
        size = int(np.prod(shape, dtype=np.int64))
        flat = packed.words[offset:offset + size]
        if dtype != np.int32:
            flat = jax.lax.bitcast_convert_type(flat, dtype)
        leaves.append(flat.reshape(shape))
    return jax.tree.unflatten(packed.treedef, leaves)
