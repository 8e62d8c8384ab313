"""Maps requests onto KV-cache blocks: block tables, prefix-cache lookups, fork and copy-on-write.

Layering (vLLM v1): the scheduler decides how many tokens each request runs this step and calls
`get_computed_blocks` / `allocate_slots` / `free`; this manager owns the per-request block tables;
`BlockPool` owns the physical blocks.

Registering blocks at allocation time: a block becomes findable by its hash as soon as
`allocate_slots` covers it, before the step that writes its KV has run. That is safe because the
scheduler calls `allocate_slots` and then runs the step before it schedules anything else, so no
other request can read the block before its KV exists (same contract as vLLM v1).

Block tables grow at the end, except that copy-on-write substitutes one entry (the shared block a
request is about to write into); the runner must apply `take_copy_ops()` in order, on device,
before the step, and refresh that request's block table row.
"""

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pjinfer.cache.block_pool import BlockPool
from pjinfer.cache.prefix_cache import BlockHash, iter_block_hashes


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens (prompt tokens looked up / served from cache)."""

    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Per-request block tables on top of a `BlockPool`."""

    def __init__(self, *, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be a positive number of tokens")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self._block_tables: dict[str, list[int]] = {}
        # Hash-chain keys of each request's leading full blocks, so later blocks chain on cheaply.
        self._block_hashes: dict[str, list[BlockHash]] = {}
        # Keys every block hash of a request mixes in (its LoRA adapter): absent = none.
        self._extra_keys: dict[str, Hashable] = {}
        self._copy_ops: list[tuple[int, int]] = []
        self._num_queried_tokens = 0
        self._num_hit_tokens = 0

    # ---- metrics -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of allocatable (non-null) blocks held by requests; evictable ones count free."""
        return 1.0 - self.pool.num_free_blocks / (self.pool.num_blocks - 1)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._num_queried_tokens, self._num_hit_tokens)

    def can_allocate(self, num_blocks_needed: int) -> bool:
        return num_blocks_needed <= self.pool.num_free_blocks

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (e.g. after a weight update); running requests keep theirs."""
        self.pool.reset_prefix_cache()

    # ---- per-request operations -----------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table (copies so COW never mutates a caller's list)."""
        return list(self._block_tables[request_id])

    def get_computed_blocks(self, token_ids: Sequence[int], extra_key: Hashable | None = None
                            ) -> tuple[list[int], int]:
        """Longest cached run of full blocks matching the prompt's prefix, and its token count.

        Never covers the whole prompt: at least one token must run to produce logits, so a
        fully cached prompt gives up its last block. Takes no references; pass the blocks to
        `allocate_slots` in the same scheduling pass. Each call counts toward the hit rate, so
        the scheduler should call it once per admission attempt it means to count.
        `extra_key` (e.g. a LoRA adapter's) keys blocks apart: only the same key's are found.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        block_ids: list[int] = []
        for block_hash in iter_block_hashes(token_ids, self.block_size, stop_block=max_blocks,
                                            extra_key=extra_key):
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_computed_tokens = len(block_ids) * self.block_size
        self._num_queried_tokens += len(token_ids)
        self._num_hit_tokens += num_computed_tokens
        return block_ids, num_computed_tokens

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        extra_key: Hashable | None = None,
    ) -> list[int] | None:
        """Make room for positions `num_computed_tokens .. + num_new_tokens - 1`.

        Returns the full block table, or None (changing nothing) when the pool is short.
        `new_computed_blocks` are prefix-cache hits, taken only on the request's first call;
        `extra_key` (first call) keys the request's blocks as in `get_computed_blocks`.
        """
        table = self._block_tables.get(request_id)
        num_tokens = num_computed_tokens + num_new_tokens
        if table is not None and not new_computed_blocks \
                and num_tokens <= len(table) * self.block_size \
                and not self._shared_write_indices(table, num_computed_tokens,
                                                   _cdiv(num_tokens, self.block_size)):
            # room in its own blocks (15 of a decode's 16 steps): nothing to allocate or copy;
            # this runs for every sequence every step, hence the shortcut
            if self.enable_prefix_caching:
                self._cache_full_blocks(request_id, table, token_ids, num_tokens)
            return list(table)
        leading, leading_hashes = self._check_new_computed_blocks(
            request_id, table, token_ids, new_computed_blocks, num_computed_tokens, extra_key
        )
        current = leading if table is None else table
        num_required = _cdiv(num_tokens, self.block_size)
        cow_indices = self._shared_write_indices(current, num_computed_tokens, num_required)
        num_fresh = max(0, num_required - len(current)) + len(cow_indices)
        # Reviving an evictable hit takes a block out of the free count as surely as a fresh one.
        num_revived = sum(1 for block_id in leading if self.pool.ref_count(block_id) == 0)
        if num_fresh + num_revived > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._admit(request_id, leading, leading_hashes, extra_key)
        self._copy_on_write(table, cow_indices, num_computed_tokens)
        table.extend(self.pool.allocate(max(0, num_required - len(table))))
        if self.enable_prefix_caching:
            self._cache_full_blocks(request_id, table, token_ids, num_tokens)
        return list(table)

    def fork(self, parent_id: str, child_id: str) -> None:
        """Child shares all of the parent's blocks (parallel sampling after the shared prefill).

        The shared partial last block is copied lazily: whichever of them writes into it first
        gets a private copy in `allocate_slots`.
        """
        if child_id in self._block_tables:
            raise ValueError(f"fork: request {child_id!r} already has blocks")
        table = list(self._block_tables[parent_id])
        self.pool.touch(table)
        self._block_tables[child_id] = table
        self._block_hashes[child_id] = list(self._block_hashes[parent_id])
        if parent_id in self._extra_keys:
            self._extra_keys[child_id] = self._extra_keys[parent_id]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (finish, abort or preemption); unknown ids are ignored."""
        table = self._block_tables.pop(request_id, None)
        if table is None:
            return
        del self._block_hashes[request_id]
        self._extra_keys.pop(request_id, None)
        self.pool.free(reversed(table))  # tail first: evicted before the more shareable head

    def take_copy_ops(self) -> list[tuple[int, int]]:
        """COW copies `(src, dst)` since the last call, to apply in order before the next step."""
        ops, self._copy_ops = self._copy_ops, []
        return ops

    # ---- helpers -----------------------------------------------------------------------------

    def _check_new_computed_blocks(
        self,
        request_id: str,
        table: list[int] | None,
        token_ids: Sequence[int],
        new_computed_blocks: Sequence[int],
        num_computed_tokens: int,
        extra_key: Hashable | None,
    ) -> tuple[list[int], list[BlockHash]]:
        """Validate prefix hits and return them with their keys.

        A hit evicted and reused since `get_computed_blocks` would silently serve another
        prompt's KV, so each block must still be indexed under this prompt's key.
        """
        if not new_computed_blocks:
            return [], []
        if table is not None:
            raise ValueError(f"request {request_id!r}: new_computed_blocks only on its first call")
        if len(new_computed_blocks) * self.block_size > num_computed_tokens:
            raise ValueError(
                f"request {request_id!r}: {len(new_computed_blocks)} computed blocks exceed "
                f"num_computed_tokens={num_computed_tokens}"
            )
        hashes = list(
            iter_block_hashes(token_ids, self.block_size, stop_block=len(new_computed_blocks),
                              extra_key=extra_key)
        )
        stored = [self.pool.block_hash(block_id) for block_id in new_computed_blocks]
        if stored != hashes:
            raise RuntimeError(
                f"request {request_id!r}: new_computed_blocks are not cached under this prompt "
                "(evicted since lookup?); call get_computed_blocks and allocate_slots in the "
                "same scheduling pass"
            )
        return list(new_computed_blocks), hashes

    def _admit(
        self, request_id: str, leading: list[int], leading_hashes: list[BlockHash],
        extra_key: Hashable | None,
    ) -> list[int]:
        self.pool.touch(leading)
        if extra_key is not None:
            self._extra_keys[request_id] = extra_key
        self._block_tables[request_id] = leading
        self._block_hashes[request_id] = leading_hashes
        return leading

    def _shared_write_indices(
        self, table: list[int], num_computed_tokens: int, num_required: int
    ) -> list[int]:
        """Existing table entries this step writes into that another request also holds."""
        first = num_computed_tokens // self.block_size
        stop = min(len(table), num_required)
        return [i for i in range(first, stop) if self.pool.ref_count(table[i]) > 1]

    def _copy_on_write(
        self, table: list[int], indices: list[int], num_computed_tokens: int
    ) -> None:
        """Give this request private copies of shared blocks it is about to write into."""
        if not indices:
            return
        fresh = self.pool.allocate(len(indices))
        for index, dst in zip(indices, fresh, strict=True):
            src = table[index]
            if index * self.block_size < num_computed_tokens:  # holds valid KV worth copying
                self._copy_ops.append((src, dst))
            table[index] = dst
            self.pool.free([src])  # still held by the other sharer(s): refcount stays >= 1

    def _cache_full_blocks(
        self, request_id: str, table: list[int], token_ids: Sequence[int], num_tokens: int
    ) -> None:
        """Index blocks that became full with known tokens under their hash-chain keys."""
        hashes = self._block_hashes[request_id]
        num_full = min(len(token_ids), num_tokens) // self.block_size
        if num_full <= len(hashes):
            return
        new_hashes = iter_block_hashes(
            token_ids,
            self.block_size,
            start_block=len(hashes),
            stop_block=num_full,
            parent_hash=hashes[-1] if hashes else None,
            extra_key=self._extra_keys.get(request_id),
        )
        for index, block_hash in enumerate(new_hashes, start=len(hashes)):
            self.pool.cache_block(table[index], block_hash)
            hashes.append(block_hash)
