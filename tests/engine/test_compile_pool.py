"""compile_pool: start-up compiles in parallel, and alone again where that failed."""

from __future__ import annotations

import logging
import threading

import pytest

from pjinfer.engine.compile_pool import compile_all


class _Compile:
    """A compile that fails its first `failures` calls (as an out-of-memory autotune would)."""

    def __init__(self, failures: int = 0):
        self.calls, self.failures, self.lock = 0, failures, threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
            if self.calls <= self.failures:
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")


def test_every_compile_runs_once_when_all_succeed():
    work = [_Compile() for _ in range(5)]
    compile_all([(f"shape {i}", w) for i, w in enumerate(work)], max_workers=3)
    assert [w.calls for w in work] == [1] * 5


def test_a_compile_that_failed_in_the_pool_is_retried_alone(caplog):
    work = [_Compile(), _Compile(failures=1), _Compile()]
    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        compile_all([(f"shape {i}", w) for i, w in enumerate(work)], max_workers=3)
    assert [w.calls for w in work] == [1, 2, 1]
    assert "compiling shape 1 failed alongside other compiles (RESOURCE_EXHAUSTED" in caplog.text


def test_a_second_failure_says_what_to_change():
    work = [("the step of 512 tokens / 512 sequences", _Compile(failures=2))]
    with pytest.raises(ValueError, match=r"compiling the step of 512 tokens / 512 sequences "
                                           r"failed: RESOURCE_EXHAUSTED.*smaller KV cache "
                                           r"\(kv_cache_memory or num_kv_blocks\)"):
        compile_all(work, max_workers=2)


def test_a_failure_without_a_message_is_retried_too(caplog):
    """An exception with an empty message still gets its warning (named by its type)."""
    calls = []

    def compile_once():
        calls.append(1)
        if len(calls) == 1:
            raise MemoryError

    with caplog.at_level(logging.WARNING, logger="pjinfer"):
        compile_all([("shape 0", compile_once)], max_workers=1)
    assert len(calls) == 2 and "(MemoryError)" in caplog.text
