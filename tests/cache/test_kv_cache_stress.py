"""Seeded random workload against a simulated device cache.

Each block holds `block_size` slots; a step "computes" a token by writing a stand-in for its KV
into its slot: a key of the token *and everything before it*, as real KV depends on the prefix.
After every operation, every request's computed positions must read back its own keys: that
catches a wrong prefix hit (even one with equal block tokens), a missed copy-on-write, or a
block handed to two owners.
"""

import random

import pytest

from pjinfer.cache.kv_cache_manager import KVCacheManager

BLOCK_SIZE = 4
NUM_BLOCKS = 48


def _kv_keys(tokens: list[int], num_tokens: int) -> list[int]:
    """Stand-in KV for positions 0..num_tokens-1: each depends on the whole prefix."""
    keys, key = [], 0
    for token in tokens[:num_tokens]:
        key = hash((key, token))
        keys.append(key)
    return keys


class Simulation:
    def __init__(self, seed: int, caching: bool):
        self.rng = random.Random(seed)
        self.manager = KVCacheManager(
            num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, enable_prefix_caching=caching
        )
        self.device = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.tokens: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # Prompts reuse a few block-sized motifs in different orders, so equal blocks often sit
        # behind different prefixes: only the hash chain tells them apart.
        motifs = [[self.rng.randrange(50) for _ in range(BLOCK_SIZE)] for _ in range(3)]
        self.prefixes = [[t for _ in range(5) for t in self.rng.choice(motifs)] for _ in range(4)]
        self.next_id = 0

    def admit(self) -> None:
        prompt = self.rng.choice(self.prefixes)[: self.rng.randrange(1, 21)]
        prompt = prompt + [self.rng.randrange(50) for _ in range(self.rng.randrange(0, 9))]
        if not prompt:
            return
        request_id, self.next_id = f"r{self.next_id}", self.next_id + 1
        hits, num_computed = self.manager.get_computed_blocks(prompt)
        assert num_computed < len(prompt)
        self.tokens[request_id] = prompt
        self.num_computed[request_id] = num_computed
        num_new = self.rng.randrange(1, len(prompt) - num_computed + 1)  # chunked prefill
        if not self.run_step(request_id, num_new, hits):
            del self.tokens[request_id], self.num_computed[request_id]

    def step(self, request_id: str) -> None:
        tokens, num_computed = self.tokens[request_id], self.num_computed[request_id]
        if num_computed == len(tokens):  # decode: the sampled token is the one to compute
            tokens.append(self.rng.randrange(50))
        num_new = self.rng.randrange(1, len(tokens) - num_computed + 1)
        if not self.run_step(request_id, num_new, ()):
            self.preempt(request_id)

    def run_step(self, request_id: str, num_new: int, hits) -> bool:
        tokens, start = self.tokens[request_id], self.num_computed[request_id]
        before = self.snapshot()
        table = self.manager.allocate_slots(request_id, tokens, start, num_new, hits)
        if table is None:
            assert self.snapshot() == before, "failed allocate_slots changed state"
            return False
        for src, dst in self.manager.take_copy_ops():
            self.device[dst] = list(self.device[src])
        keys = _kv_keys(tokens, start + num_new)
        for pos in range(start, start + num_new):
            self.device[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] = keys[pos]
        self.num_computed[request_id] = start + num_new
        return True

    def preempt(self, request_id: str) -> None:
        """Recompute-style preemption: drop blocks; the tokens get re-prefilled on readmission."""
        self.manager.free(request_id)
        tokens = self.tokens.pop(request_id)
        del self.num_computed[request_id]
        hits, num_computed = self.manager.get_computed_blocks(tokens)
        self.tokens[request_id], self.num_computed[request_id] = tokens, num_computed
        if not self.run_step(request_id, len(tokens) - num_computed, hits):
            del self.tokens[request_id], self.num_computed[request_id]

    def fork(self, parent_id: str) -> None:
        child_id, self.next_id = f"r{self.next_id}", self.next_id + 1
        self.manager.fork(parent_id, child_id)
        self.tokens[child_id] = list(self.tokens[parent_id])
        self.num_computed[child_id] = self.num_computed[parent_id]

    def finish(self, request_id: str) -> None:
        self.manager.free(request_id)
        del self.tokens[request_id], self.num_computed[request_id]

    def snapshot(self):
        manager = self.manager
        tables = {rid: manager.block_table(rid) for rid in manager._block_tables}
        refs = [manager.pool.ref_count(b) for b in range(NUM_BLOCKS)]
        return tables, refs, manager.num_free_blocks, manager.pool.num_cached_blocks

    def verify_contents(self) -> None:
        for request_id, tokens in self.tokens.items():
            table = self.manager.block_table(request_id)
            num_computed = self.num_computed[request_id]
            for pos, key in enumerate(_kv_keys(tokens, num_computed)):
                assert self.device[table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE] == key, pos

    def random_op(self) -> None:
        running = sorted(self.tokens)
        roll = self.rng.random()
        if not running or roll < 0.25:
            self.admit()
        elif roll < 0.75:
            self.step(self.rng.choice(running))
        elif roll < 0.85:
            self.fork(self.rng.choice(running))
        elif roll < 0.99:
            self.finish(self.rng.choice(running))
        else:
            self.manager.reset_prefix_cache()


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_keeps_invariants_and_contents(seed, caching, check):
    sim = Simulation(seed, caching)
    for _ in range(600):
        sim.random_op()
        check(sim.manager)
        sim.verify_contents()
    for request_id in sorted(sim.tokens):
        sim.finish(request_id)
    check(sim.manager)
    assert sim.manager.num_free_blocks == NUM_BLOCKS - 1
    if caching:
        assert sim.manager.prefix_cache_stats.hits > 0
