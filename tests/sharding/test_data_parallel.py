"""Data-parallel replicas on 8 emulated CPU devices: dp=2 x tp=2 and dp=4 give one replica's
greedy tokens, each replica on its own devices; requests sharing a prefix go to the replica that
cached it, as the per-replica metrics show."""

from __future__ import annotations

import asyncio

import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pjinfer.engine.config import EngineConfig
from pjinfer.engine.data_parallel import DataParallelEngine, replica_devices
from pjinfer.server.metrics import ServerMetrics
from pjinfer.server.model_pool import ModelPool
from tests.sharding.test_engine_tp import GREEDY, PROMPTS, _generate


def _config(path, tp: int, **kwargs) -> EngineConfig:
    return EngineConfig(model=str(path), dtype="float32", tensor_parallel_size=tp,
                        max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=64,
                        warmup=False, **kwargs)


async def _run(engine, prompts) -> list[list[int]]:
    async def one(i, prompt):
        async for out in engine.generate(prompt, GREEDY, request_id=f"r{i}"):
            final = out
        return final.outputs[0].token_ids

    engine.start()
    try:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))
    finally:
        engine.shutdown()


@pytest.mark.parametrize("dp, tp", [(2, 2), (4, 1)])
def test_replicas_match_one_engine(gqa8_model, dp, tp):
    expected = _generate(gqa8_model, 1)
    engine = DataParallelEngine(_config(gqa8_model, tp), dp)
    groups = [{d for leaf in jax.tree.leaves(r.engine.engine.runner.params)
               for d in leaf.devices()} for r in engine.replicas]
    assert all(len(g) == tp for g in groups) and len(set().union(*groups)) == dp * tp
    tokens = asyncio.run(_run(engine, PROMPTS * 2))  # every replica gets some
    assert tokens == expected * 2
    assert all(r.routed > 0 for r in engine.replicas) and all(r.load == 0 for r in
                                                              engine.replicas)


def test_too_many_replicas_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 16 devices but 8"):
        replica_devices(8, 2)


def _replica_samples(text: str, name: str) -> dict[str, float]:
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_prefix_affinity_in_per_replica_metrics(gqa8_model):
    engine = DataParallelEngine(_config(gqa8_model, 1, enable_prefix_caching=True,
                                        block_size=4, max_model_len=128), 2)
    pool = ModelPool.of_engine(engine, "gqa8")
    metrics = ServerMetrics(pool.stats_by_model, "gqa8")
    metrics.watch_pool(pool)
    shared = list(range(3, 40))  # 9 full blocks of 4
    prompts = [shared + [50 + i] for i in range(4)]

    async def run():
        engine.start()
        try:
            for i, prompt in enumerate(prompts):  # one after another: each can hit the cache
                async for _ in engine.generate(prompt, GREEDY, request_id=f"p{i}"):
                    pass
            return metrics.render().decode()
        finally:
            engine.shutdown()

    text = asyncio.run(run())
    prefix_routed = _replica_samples(text, "pjinfer:dp_prefix_routed_requests_total")
    routed = _replica_samples(text, "pjinfer:dp_routed_requests_total")
    hits = _replica_samples(text, "pjinfer:dp_prefix_cache_hits_total")
    owner = max(routed, key=routed.get)
    assert routed[owner] == 4 and prefix_routed[owner] == 3  # all on the one that cached it
    assert hits[owner] >= 3 * 36 and sum(hits.values()) == hits[owner]
