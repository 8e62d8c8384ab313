import pytest

from pjinfer.cache.block_pool import BlockPool, NoFreeBlocksError


def _pool(num_blocks: int = 6) -> BlockPool:
    return BlockPool(num_blocks, enable_prefix_caching=True)


def test_allocate_hands_out_every_block_but_the_null_block():
    pool = _pool()
    assert pool.num_free_blocks == 5
    block_ids = pool.allocate(5)
    assert sorted(block_ids) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.free(block_ids)
    assert pool.num_free_blocks == 5
    assert all(pool.ref_count(b) == 0 for b in range(6))


def test_too_few_blocks_and_double_free_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, enable_prefix_caching=False)
    pool = _pool()
    (block_id,) = pool.allocate(1)
    pool.free([block_id])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block_id])


def test_freed_cached_block_stays_findable_and_counts_as_free():
    pool = _pool()
    (block_id,) = pool.allocate(1)
    pool.cache_block(block_id, b"h")
    pool.free([block_id])
    assert pool.num_free_blocks == 5
    assert pool.get_cached_block(b"h") == block_id
    pool.touch([block_id])  # revived by a prefix hit: no longer evictable
    assert pool.ref_count(block_id) == 1
    assert pool.num_free_blocks == 4
    assert block_id not in pool.allocate(4)


def test_fresh_blocks_are_used_before_evicting_cached_ones():
    pool = _pool()
    (cached,) = pool.allocate(1)
    pool.cache_block(cached, b"h")
    pool.free([cached])
    assert cached not in pool.allocate(4)
    assert pool.get_cached_block(b"h") == cached
    assert pool.allocate(1) == [cached]  # only now evicted
    assert pool.get_cached_block(b"h") is None
    assert pool.block_hash(cached) is None


def test_eviction_is_least_recently_freed_first():
    pool = _pool(4)
    a, b, c = pool.allocate(3)
    for block_id, key in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(block_id, key)
    pool.free([b])
    pool.free([a])
    pool.free([c])
    pool.touch([a])  # reuse removes a from the LRU set; b is now the oldest
    assert pool.allocate(1) == [b]
    assert pool.get_cached_block(b"b") is None
    assert pool.allocate(1) == [c]
    assert pool.get_cached_block(b"a") == a
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_duplicate_key_keeps_first_block_and_second_frees_plainly():
    pool = _pool()
    first, second = pool.allocate(2)
    pool.cache_block(first, b"same")
    pool.cache_block(second, b"same")
    assert pool.get_cached_block(b"same") == first
    assert pool.block_hash(second) is None
    assert pool.num_cached_blocks == 1


def test_caching_disabled_indexes_nothing():
    pool = BlockPool(4, enable_prefix_caching=False)
    (block_id,) = pool.allocate(1)
    pool.cache_block(block_id, b"h")
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_turns_evictable_blocks_fresh():
    pool = _pool()
    used, idle = pool.allocate(2)
    pool.cache_block(used, b"u")
    pool.cache_block(idle, b"i")
    pool.free([idle])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0
    assert pool.get_cached_block(b"u") is None and pool.block_hash(used) is None
    assert pool.num_free_blocks == 4
    pool.free([used])
    assert pool.num_free_blocks == 5
