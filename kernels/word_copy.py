"""A copy of the step's packed host inputs into a buffer the executable owns.

XLA replays a step's kernels as CUDA graphs (command buffers) and, before each replay,
updates every recorded kernel whose buffers moved since the last call. The packed inputs
(`pjinfer.engine.host_pack`) arrive in a new device buffer every step, and without this copy
every layer's kernels read them (positions, slot mapping, block tables, sequence lengths):
on the H200 the 488-command graph of a Llama-3-8B decode step was re-recorded on every
call, 0.6-1.3 ms of the launching thread's time (RESULTS.md, round 6). Copied once at the
start of the step, the inputs live in the executable's temporary buffer, so only this one
kernel reads the moving argument. XLA would fuse a plain copy away; a Pallas call it cannot.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

WORD_ALIGN = 128  # packed buffers are padded to a multiple of this many int32 words
_MAX_BLOCK = 4096


def _block(n: int) -> int:
    """The largest power of two <= _MAX_BLOCK dividing n (n a multiple of WORD_ALIGN)."""
    block = _MAX_BLOCK
    while n % block:
        block //= 2
    return block


def _copy_kernel(src_ref, dst_ref):
    dst_ref[...] = src_ref[...]


@functools.partial(jax.jit, static_argnames=("interpret",))
def copy_words(words: jax.Array, *, interpret: bool = False) -> jax.Array:
    """`words` [n] int32 (n a multiple of WORD_ALIGN) copied by one Pallas kernel."""
    (n,) = words.shape
    if n % WORD_ALIGN:
        raise ValueError(f"copy_words takes a multiple of {WORD_ALIGN} words, got {n}; "
                         "pad the buffer (host_pack.pack does)")
    block = _block(n)
    spec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct((n,), words.dtype),
        grid=(n // block,),
        in_specs=[spec],
        out_specs=spec,
        interpret=interpret,
    )(words)


def copy_words_reference(words: jax.Array) -> jax.Array:
    """What the kernel computes: the same words (XLA may alias or fuse it away)."""
    return jnp.copy(words)
