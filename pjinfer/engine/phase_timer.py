"""Seconds per start-up phase (weights, KV cache, compiles, tokenizer): a restart's cost,
reported by `LLMEngine.startup_phases` and the benchmarks."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Record the block's wall time as `phases[name]`."""
    start = time.perf_counter()
    yield
    phases[name] = time.perf_counter() - start


def timed_call(phases: dict[str, float], name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, timed as `phases[name]` (for a call handed to a thread pool)."""
    with timed(phases, name):
        return fn(*args)
