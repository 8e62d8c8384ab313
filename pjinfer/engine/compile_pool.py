"""Compiling many step shapes at start-up: in parallel, with a one-at-a-time retry."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("pjinfer")


def compile_all(work: list[tuple[str, Callable[[], object]]], *,
                max_workers: int | None = None) -> None:
    """Run each (description, compile) in a thread pool (XLA compiles release the GIL), then
    once more, one at a time, those that failed: on a GPU each compile autotunes its matmuls
    in device scratch memory, and many at once can run out of what the KV cache left (seen on
    the H200: Llama-3-8B's warm-up, 16 compiles at once). A second failure is raised with
    what to change (a ValueError, as the engine's other sizing errors: the command line shows
    it as a usage error)."""
    workers = max_workers or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = [(what, fn, pool.submit(fn)) for what, fn in work]
    for what, fn, job in jobs:
        error = job.exception()
        if error is None:
            continue
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        log.warning("compiling %s failed alongside other compiles (%s); retrying it alone",
                    what, first_line[:200])
        try:
            fn()
        except Exception as e:
            raise ValueError(
                f"compiling {what} failed: {e}. If the device ran out of memory, leave XLA "
                "room to compile with a smaller KV cache (kv_cache_memory or num_kv_blocks) "
                "or lower max_num_seqs / max_num_batched_tokens") from e
