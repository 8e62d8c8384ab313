"""Fixtures of the engine tests."""

from __future__ import annotations

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

JAX_CACHE_FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
                   "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture(scope="module")
def restore_jax_cache_flags():
    """compilation_cache_dir sets process-wide JAX flags: put them back after the module."""
    saved = {name: getattr(jax.config, name) for name in JAX_CACHE_FLAGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()
