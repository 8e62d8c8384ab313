"""The check every engine test ends with: the engine came back idle and leaked no KV block."""

from __future__ import annotations


def assert_idle(engine) -> None:
    """Nothing running, waiting (parked structured-output requests count) or in flight, and
    every KV block back in the pool."""
    stats = engine.get_stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, "KV blocks leaked"
    assert not engine.has_unfinished_requests()
