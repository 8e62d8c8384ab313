"""JAX's persistent compilation cache, which the `compilation_cache_dir` argument turns on."""

from __future__ import annotations


def use_compilation_cache(path: str) -> None:
    """Store every compiled executable under `path`, so a restart loads it instead of compiling.

    The settings are process-wide JAX state, set by whoever builds the engine, before the first
    compile. No compile-time floor and no size floor (-1: JAX may not raise it for the cache's
    filesystem either): the step executables are few, and each one costs seconds to compile.
    """
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
