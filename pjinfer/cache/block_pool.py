"""Physical KV-cache blocks: reference counts, the free lists and the prefix-cache index.

The pool knows nothing about requests or tokens; `KVCacheManager` maps requests onto it.

Block 0 is the reserved null block: it is never handed out, so the runner can pad block tables
with 0 and point padding slots at it without touching live KV.

A block with refcount 0 sits in exactly one of two free lists:
  * `_free_fresh`: holds nothing reusable; handed out first, FIFO.
  * `_evictable`: a cached full block (it has a hash). It keeps its KV and hash so a later prompt
    can revive it; it is evicted (hash dropped) only when no fresh block is left, least recently
    freed first. Reviving it (`touch`) removes it from this list.
Every operation is O(1) per block (deque / OrderedDict / dict).
"""

from collections import OrderedDict, deque
from collections.abc import Iterable

from pjinfer.cache.prefix_cache import BlockHash

NULL_BLOCK_ID = 0


class NoFreeBlocksError(RuntimeError):
    """More blocks were requested than are free; callers check `num_free_blocks` first."""


class BlockPool:
    """Reference-counted allocator over `num_blocks` KV-cache blocks (block 0 reserved)."""

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool):
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks}: need at least 2 (block 0 is the reserved null block)"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._free_fresh: deque[int] = deque(range(1, num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now, evictable cached blocks included."""
        return len(self._free_fresh) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently findable by hash, in use or evictable."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._block_hashes[block_id]

    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out `num_blocks` blocks with refcount 1; fresh ones first, then evict LRU."""
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, only {self.num_free_blocks} free"
            )
        block_ids = [self._pop_free_block() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def _pop_free_block(self) -> int:
        if self._free_fresh:
            return self._free_fresh.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hashes[block_id]]
        self._block_hashes[block_id] = None
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks in use or evictable (a prefix hit, or a fork)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                # KeyError here means a fresh free block was touched: a caller bug, not a hit.
                del self._evictable[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; at 0 a cached block turns evictable (MRU end), others fresh.

        Callers pass a request's blocks last-first so its tail blocks, the least likely to be
        shared by another prompt, are evicted before its head.
        """
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} freed more often than allocated")
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] > 0:
                continue
            if self._block_hashes[block_id] is None:
                self._free_fresh.append(block_id)
            else:
                self._evictable[block_id] = None

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """Block holding the KV keyed by `block_hash`, or None on a miss."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Index an in-use full block under its hash-chain key.

        A block already indexed keeps its key. If another block already holds this key (two
        requests computed the same prefix in one step), the first one stays the cached copy and
        this block is freed as a plain block later.
        """
        if not self.enable_prefix_caching or self._block_hashes[block_id] is not None:
            return
        if block_hash in self._cached:
            return
        self._cached[block_hash] = block_id
        self._block_hashes[block_id] = block_hash

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after new weights); evictable blocks become plain free blocks.

        In-use blocks keep their KV for their current owners but are no longer findable.
        """
        for block_id in self._cached.values():
            self._block_hashes[block_id] = None
        self._cached.clear()
        self._free_fresh.extend(self._evictable)
        self._evictable.clear()
