"""LoRA under tensor parallelism on CPU devices: the slot arrays shard with their base layer
(column-parallel: A replicated, B split on out; row-parallel: A split on in, B replicated)
and a mixed batch still equals peft, at tp=2 and at tp=4 (kv heads duplicated: 2 kv heads);
data-parallel replicas serve adapters too."""

from __future__ import annotations

import asyncio

import pytest
from jax.sharding import PartitionSpec as P

from pjinfer import LLM
from pjinfer.engine.config import EngineConfig
from pjinfer.engine.data_parallel import DataParallelEngine
from tests.lora.test_engine_lora import GREEDY, ORDER, PROMPTS, _requests, check_against_peft


@pytest.mark.parametrize("tp", [2, 4])
def test_mixed_batch_matches_peft_sharded(llama_lora, tp):
    llm = LLM(str(llama_lora.base), enable_lora=True, max_loras=3, max_lora_rank=16,
              tensor_parallel_size=tp, max_model_len=128, max_num_seqs=8,
              max_num_batched_tokens=256, dtype="float32")
    layer = llm.engine.runner.lora_weights[0]
    assert layer["q_proj"][0].sharding.spec == P(None, None, None)
    assert layer["q_proj"][1].sharding.spec == P(None, None, "tp")
    assert layer["k_proj"][1].shape[-1] == 2 * 16 * max(1, tp // 2)  # duplicated kv heads
    assert layer["o_proj"][0].sharding.spec == P("tp", None, None)
    assert layer["down_proj"][1].sharding.spec == P(None, None, None)
    reqs = _requests(llama_lora)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[reqs.get(n) for n in ORDER])
    check_against_peft(llama_lora, outs)


def test_data_parallel_replicas_serve_adapters(llama_lora):
    """dp=2: each replica runs the adapters of the requests routed to it (peft's tokens), and
    add_lora / remove_lora reach every replica."""
    engine = DataParallelEngine(EngineConfig(
        model=str(llama_lora.base), enable_lora=True, max_loras=3, max_lora_rank=16,
        max_model_len=128, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64,
        dtype="float32", warmup=False), 2)
    reqs = _requests(llama_lora)
    assert engine.add_lora(reqs["all7"])

    async def run():
        async def one(i, prompt, lora):
            async for out in engine.generate(prompt, GREEDY, request_id=f"r{i}",
                                             lora_request=lora):
                final = out
            return final

        engine.start()
        try:
            return await asyncio.gather(*(one(i, p, reqs.get(n)) for i, (p, n)
                                          in enumerate(zip(PROMPTS, ORDER, strict=True))))
        finally:
            engine.shutdown()

    check_against_peft(llama_lora, asyncio.run(run()))
    assert all(r.routed > 0 for r in engine.replicas)
    assert engine.remove_lora(reqs["all7"])
