"""Hash-chain keys for prefix caching.

A full block's KV depends on every token before it, not only on its own tokens, so its cache key
chains the parent block's key with this block's token ids (and an optional extra key, e.g. a LoRA
or model salt). Two prompts share a cached block only if they agree on everything up to its end.

SHA-256 rather than Python's `hash`: a 64-bit collision would silently serve another prompt's KV,
and the digest is stable across processes should the cache ever be shared or persisted.
"""

import hashlib
from array import array
from collections.abc import Hashable, Iterator, Sequence

BlockHash = bytes

# Parent key of a prompt's first block; a real digest equal to it is a 2**-256 event.
_ROOT_HASH = bytes(32)


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: Hashable | None = None
) -> BlockHash:
    """Key of one full block: SHA-256 over parent key, int64 token ids and the extra key."""
    digest = hashlib.sha256(parent_hash or _ROOT_HASH)
    digest.update(len(token_ids).to_bytes(4, "little"))
    digest.update(array("q", token_ids).tobytes())  # accepts lists, tuples and numpy int arrays
    if extra_key is not None:
        digest.update(repr(extra_key).encode())
    return digest.digest()


def iter_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    start_block: int = 0,
    stop_block: int | None = None,
    parent_hash: BlockHash | None = None,
    extra_key: Hashable | None = None,
) -> Iterator[BlockHash]:
    """Keys of full blocks `start_block .. stop_block - 1`, lazily, so a lookup can stop at a miss.

    `parent_hash` must be the key of block `start_block - 1` (None when starting at block 0).
    Blocks past the last full one are never hashed: only full blocks are cached.
    """
    num_full = len(token_ids) // block_size
    stop = num_full if stop_block is None else min(stop_block, num_full)
    for index in range(start_block, stop):
        chunk = token_ids[index * block_size : (index + 1) * block_size]
        parent_hash = hash_block_tokens(parent_hash, chunk, extra_key)
        yield parent_hash
