import pytest

from pjinfer.cache.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4


def _manager(num_blocks: int = 16, *, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=num_blocks, block_size=BLOCK_SIZE, enable_prefix_caching=caching
    )


def _admit(manager: KVCacheManager, request_id: str, tokens: list[int]) -> list[int] | None:
    """Prefill a whole prompt the way the scheduler does: lookup, then allocate the rest."""
    hit_blocks, num_computed = manager.get_computed_blocks(tokens)
    return manager.allocate_slots(
        request_id, tokens, num_computed, len(tokens) - num_computed, hit_blocks
    )


def test_allocation_grows_table_and_free_returns_every_block(check):
    manager = _manager(caching=False)
    tokens = list(range(10))
    table = manager.allocate_slots("a", tokens, 0, 10)
    assert len(table) == 3 and 0 not in table
    assert manager.num_free_blocks == 12
    assert manager.usage == pytest.approx(3 / 15)
    table = manager.allocate_slots("a", tokens + [10, 11], 10, 2)  # fits the third block
    assert len(table) == 3
    table = manager.allocate_slots("a", tokens + [10, 11, 12], 12, 1)
    assert len(table) == 4 and manager.block_table("a") == table
    check(manager)
    manager.free("a")
    manager.free("a")  # idempotent
    assert manager.num_free_blocks == 15 and manager.usage == 0.0
    check(manager)


def test_exhaustion_returns_none_and_changes_nothing(check):
    manager = _manager(num_blocks=5)
    assert manager.allocate_slots("a", list(range(8)), 0, 8) is not None
    before = (manager.num_free_blocks, manager.block_table("a"))
    assert manager.allocate_slots("b", list(range(100, 112)), 0, 12) is None
    assert manager.allocate_slots("a", list(range(20)), 8, 12) is None
    assert (manager.num_free_blocks, manager.block_table("a")) == before
    with pytest.raises(KeyError):
        manager.block_table("b")
    assert manager.can_allocate(2) and not manager.can_allocate(3)
    check(manager)


def test_prefix_hits_follow_the_hash_chain():
    manager = _manager()
    prompt = list(range(14))  # blocks [0..3] [4..7] [8..11] full, [12, 13] partial
    _admit(manager, "a", prompt)
    table_a = manager.block_table("a")
    assert manager.get_computed_blocks(prompt[:9] + [99]) == (table_a[:2], 8)
    assert manager.get_computed_blocks(prompt[:12] + [7, 7, 7]) == (table_a[:3], 12)
    # A differing token in block 1 stops the match there, even though block 2 matches.
    diverged = prompt[:5] + [99] + prompt[6:]
    assert manager.get_computed_blocks(diverged) == (table_a[:1], 4)
    assert manager.get_computed_blocks([99] + prompt[1:]) == ([], 0)
    assert manager.get_computed_blocks(prompt[:3]) == ([], 0)  # partial blocks never cached


def test_fully_cached_prompt_gives_up_its_last_block():
    manager = _manager()
    prompt = list(range(12))
    _admit(manager, "a", prompt)
    table_a = manager.block_table("a")
    assert manager.get_computed_blocks(prompt) == (table_a[:2], 8)
    assert manager.get_computed_blocks(prompt[:8]) == (table_a[:1], 4)
    assert manager.get_computed_blocks(prompt[:4]) == ([], 0)


def test_hit_rate_counts_tokens():
    manager = _manager()
    _admit(manager, "a", list(range(8)))  # 8 queried, 0 hit
    _admit(manager, "b", list(range(8)) + [50, 51])  # 10 queried, 8 hit
    stats = manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (18, 8)
    assert stats.hit_rate == pytest.approx(8 / 18)


def test_caching_disabled_never_hits():
    manager = _manager(caching=False)
    _admit(manager, "a", list(range(12)))
    assert manager.get_computed_blocks(list(range(12))) == ([], 0)
    assert manager.prefix_cache_stats.hit_rate == 0.0


def test_shared_prefix_refcounts_with_several_sharers(check):
    manager = _manager()
    prompt = list(range(8))
    _admit(manager, "a", prompt + [1])
    _admit(manager, "b", prompt + [2])
    _admit(manager, "c", prompt + [3])
    shared = manager.block_table("a")[:2]
    assert manager.block_table("b")[:2] == shared == manager.block_table("c")[:2]
    assert [manager.pool.ref_count(b) for b in shared] == [3, 3]
    check(manager)
    manager.free("a")
    manager.free("b")
    assert [manager.pool.ref_count(b) for b in shared] == [1, 1]
    manager.free("c")
    assert manager.get_computed_blocks(prompt + [4]) == (shared, 8)
    assert manager.num_free_blocks == 15
    check(manager)


def test_reviving_evictable_hits_counts_against_free_blocks(check):
    manager = _manager(num_blocks=5)  # 4 usable blocks
    prompt = list(range(12))
    _admit(manager, "a", prompt)
    manager.free("a")  # 3 cached blocks evictable, 4 free in total
    hits, num_computed = manager.get_computed_blocks(prompt + list(range(50, 58)))
    assert num_computed == 12
    # 3 revived + 2 fresh = 5 > 4: must fail without touching the evictable hits.
    assert manager.allocate_slots("b", prompt + list(range(50, 58)), 12, 8, hits) is None
    assert manager.num_free_blocks == 4 and manager.pool.num_cached_blocks == 3
    table = manager.allocate_slots("b", prompt + [50], 12, 1, hits)
    assert table[:3] == hits and manager.num_free_blocks == 0
    check(manager)


def test_freed_request_evicts_its_tail_first():
    manager = _manager(num_blocks=4)  # 3 usable blocks
    prompt = list(range(12))
    table_a = _admit(manager, "a", prompt)
    manager.free("a")
    assert manager.allocate_slots("b", [99], 0, 1) == table_a[2:]  # evicts a's last block
    assert manager.get_computed_blocks(prompt + [1]) == (table_a[:2], 8)


def test_stale_or_late_computed_blocks_are_rejected():
    manager = _manager(num_blocks=4)
    prompt = list(range(8))
    _admit(manager, "a", prompt)
    manager.free("a")
    hits, num_computed = manager.get_computed_blocks(prompt + [9])
    manager.allocate_slots("other", list(range(100, 112)), 0, 12)  # evicts every cached block
    with pytest.raises(RuntimeError, match="not cached"):
        manager.allocate_slots("b", prompt + [9], num_computed, 1, hits)
    with pytest.raises(ValueError, match="first call"):
        manager.allocate_slots("other", list(range(100, 113)), 12, 1, [1])


def test_chunked_prefill_registers_only_computed_full_blocks():
    manager = _manager()
    prompt = list(range(12))
    manager.allocate_slots("a", prompt, 0, 6)  # positions 0..5: only block 0 is full
    assert manager.get_computed_blocks(prompt)[1] == 4
    manager.allocate_slots("a", prompt, 6, 6)
    assert manager.get_computed_blocks(prompt + [1])[1] == 12


def test_preempted_request_recomputes_from_its_own_cache(check):
    manager = _manager()
    tokens = list(range(10))
    _admit(manager, "a", tokens)
    manager.free("a")
    table = _admit(manager, "a", tokens)
    assert manager.prefix_cache_stats.hits == 8 and len(table) == 3
    check(manager)


def test_reset_prefix_cache_drops_hits_but_keeps_running_requests(check):
    manager = _manager()
    prompt = list(range(8))
    _admit(manager, "a", prompt + [1])
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(prompt + [1]) == ([], 0)
    assert len(manager.block_table("a")) == 3
    manager.free("a")
    assert manager.num_free_blocks == 15 and manager.pool.num_cached_blocks == 0
    check(manager)


def test_fork_then_write_into_shared_partial_block_copies_it(check):
    manager = _manager()
    prompt = list(range(6))  # block 0 full, block 1 holds 2 tokens
    parent = _admit(manager, "p", prompt)
    manager.fork("p", "c")
    assert manager.block_table("c") == parent
    assert [manager.pool.ref_count(b) for b in parent] == [2, 2]
    child = manager.allocate_slots("c", prompt + [7], 6, 1)
    assert child[0] == parent[0] and child[1] not in parent
    assert manager.take_copy_ops() == [(parent[1], child[1])]
    assert manager.take_copy_ops() == []
    assert [manager.pool.ref_count(b) for b in parent] == [2, 1]
    # The parent is now the partial block's only owner: it writes in place, no copy.
    assert manager.allocate_slots("p", prompt + [8], 6, 1) == parent
    assert manager.take_copy_ops() == []
    check(manager)
    manager.free("p")
    manager.free("c")
    assert manager.num_free_blocks == 15
    check(manager)


def test_fork_at_block_boundary_shares_full_blocks_without_copies(check):
    manager = _manager()
    prompt = list(range(8))
    parent = _admit(manager, "p", prompt)
    manager.fork("p", "c")
    child = manager.allocate_slots("c", prompt + [1], 8, 1)
    assert child[:2] == parent and len(child) == 3
    assert manager.take_copy_ops() == []
    assert [manager.pool.ref_count(b) for b in parent] == [2, 2]
    with pytest.raises(ValueError, match="already has blocks"):
        manager.fork("p", "c")
    check(manager)


@pytest.mark.parametrize("caching", [True, False])
def test_no_leaks_after_mixed_workload(caching, check):
    manager = _manager(num_blocks=32, caching=caching)
    prompt = list(range(10))
    for i in range(4):
        _admit(manager, f"r{i}", prompt + [i] * (i + 1))
    manager.fork("r0", "r0-1")
    manager.allocate_slots("r0-1", prompt + [0, 5], 11, 1)
    manager.allocate_slots("r3", prompt + [3] * 4 + [6], 14, 1)
    check(manager)
    for request_id in ("r0", "r1", "r2", "r3", "r0-1"):
        manager.free(request_id)
    assert manager.num_free_blocks == 31 and manager.usage == 0.0
    check(manager)
