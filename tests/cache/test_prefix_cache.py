import numpy as np

from pjinfer.cache.prefix_cache import hash_block_tokens, iter_block_hashes


def test_hash_is_deterministic_and_container_independent():
    tokens = [5, 6, 7, 8]
    expected = hash_block_tokens(None, tokens)
    assert hash_block_tokens(None, tuple(tokens)) == expected
    assert hash_block_tokens(None, np.array(tokens, dtype=np.int32)) == expected
    assert len(expected) == 32


def test_hash_chains_parent_and_extra_key():
    tokens = [1, 2, 3, 4]
    root = hash_block_tokens(None, tokens)
    assert hash_block_tokens(root, tokens) != root
    assert hash_block_tokens(None, tokens, extra_key="lora-a") != root
    assert hash_block_tokens(None, tokens, extra_key="lora-a") != hash_block_tokens(
        None, tokens, extra_key="lora-b"
    )
    assert hash_block_tokens(None, [1, 2, 3, 5]) != root


def test_iter_block_hashes_covers_full_blocks_only_and_resumes():
    tokens = list(range(11))  # block_size 4: two full blocks, 3 leftover tokens
    chain = list(iter_block_hashes(tokens, 4))
    assert chain == [
        hash_block_tokens(None, tokens[:4]),
        hash_block_tokens(chain[0], tokens[4:8]),
    ]
    resumed = list(iter_block_hashes(tokens, 4, start_block=1, parent_hash=chain[0]))
    assert resumed == chain[1:]
    assert list(iter_block_hashes(tokens, 4, stop_block=1)) == chain[:1]
