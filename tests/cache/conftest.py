"""Shared invariant check for the KV-cache manager tests."""

from collections import Counter

import pytest

from pjinfer.cache.kv_cache_manager import KVCacheManager


def assert_consistent(manager: KVCacheManager) -> None:
    """Refcounts equal table occurrences; every block is used xor free; the hash index agrees."""
    pool = manager.pool
    tables = [manager.block_table(rid) for rid in manager._block_tables]
    held = Counter(block_id for table in tables for block_id in table)
    assert 0 not in held, "null block handed out"
    assert all(len(set(table)) == len(table) for table in tables)
    for block_id in range(1, pool.num_blocks):
        assert pool.ref_count(block_id) == held[block_id], block_id
    fresh, evictable = set(pool._free_fresh), set(pool._evictable)
    assert len(fresh) == len(pool._free_fresh) and not fresh & evictable
    assert fresh | evictable == {b for b in range(1, pool.num_blocks) if held[b] == 0}
    assert pool.num_free_blocks + len(held) == pool.num_blocks - 1
    assert all(pool.block_hash(b) is None for b in fresh)
    assert all(pool.block_hash(b) is not None for b in evictable)
    for block_hash, block_id in pool._cached.items():
        assert pool.block_hash(block_id) == block_hash
    hashed = [b for b in range(pool.num_blocks) if pool.block_hash(b) is not None]
    assert len(hashed) == len(pool._cached)


@pytest.fixture
def check():
    return assert_consistent
