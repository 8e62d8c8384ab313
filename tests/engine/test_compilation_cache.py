"""compilation_cache_dir: one definition of what JAX's persistent cache keeps."""

from __future__ import annotations

import jax
import pytest

from pjinfer.engine.compilation_cache import use_compilation_cache

FLAGS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
         "jax_persistent_cache_min_entry_size_bytes")


@pytest.fixture
def restore_jax_flags():
    """The flags are process-wide: put them back for the tests that follow."""
    saved = {name: getattr(jax.config, name) for name in FLAGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)


def test_every_executable_is_kept(tmp_path, restore_jax_flags):
    use_compilation_cache(str(tmp_path))
    assert [getattr(jax.config, name) for name in FLAGS] == [str(tmp_path), 0.0, -1]
