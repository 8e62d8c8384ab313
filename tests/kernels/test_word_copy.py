"""The staging copy of a step's packed inputs (interpret mode on CPU, compiled on a GPU)
against its reference, at lengths that tile with one, several and the smallest blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.kernels import ops
from pjinfer.kernels.word_copy import WORD_ALIGN, _block, copy_words, copy_words_reference

INTERPRET = jax.default_backend() != "gpu"


@pytest.mark.parametrize("n", [128, 384, 4096, 4096 + 640, 3 * 8192])
def test_kernel_copies_every_word(n):
    rng = np.random.default_rng(n)
    words = jnp.asarray(rng.integers(-2**31, 2**31 - 1, size=n, dtype=np.int64)
                        .astype(np.int32))
    out = copy_words(words, interpret=INTERPRET)
    assert out.dtype == jnp.int32 and out.shape == (n,)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(copy_words_reference(words)))


def test_blocks_divide_the_buffer():
    for n in range(WORD_ALIGN, 40 * WORD_ALIGN, WORD_ALIGN):
        block = _block(n)
        assert n % block == 0 and block >= WORD_ALIGN and block & (block - 1) == 0


def test_unaligned_length_is_refused():
    with pytest.raises(ValueError, match="multiple of 128 words, got 130"):
        copy_words(jnp.zeros(130, jnp.int32), interpret=True)


def test_stage_words_is_the_identity_where_nothing_is_recorded():
    words = jnp.arange(256, dtype=jnp.int32)
    for backend in ("reference", "auto"):
        if backend == "auto" and jax.default_backend() == "gpu":
            continue
        assert ops.stage_words(words, backend) is words
