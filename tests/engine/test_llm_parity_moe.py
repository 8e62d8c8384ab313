"""Mixtral, Qwen2-MoE and Qwen3-MoE through the engine equal transformers, token for token.

One engine per architecture with every path that could break routing at once: 16-token
chunks (chunked prefill), a KV cache of 10 blocks (preemption and recompute), prefix caching
(prompts sharing a 16-token prefix, then two of them again) and batches padded to a
bucket (padding tokens must not disturb the real ones' experts).
"""

from __future__ import annotations

import random

import pytest

from pjinfer import LLM, SamplingParams
from tests.engine.idle import assert_idle

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(seed: int) -> list[list[int]]:
    """Six prompts of 20-31 tokens sharing their first 16 (one KV block: a prefix hit)."""
    rng = random.Random(seed)
    prefix = [1] + [rng.randrange(3, 128) for _ in range(15)]
    return [prefix + [rng.randrange(3, 128) for _ in range(rng.randrange(4, 16))]
            for _ in range(6)]


@pytest.fixture(scope="module")
def hf_greedy(moe_models):
    import torch
    import transformers

    def greedy(name: str, prompts: list[list[int]]) -> list[list[int]]:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            moe_models[name], dtype=torch.float32).eval()
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]

    return greedy


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_chunked_preempted_prefix_cached_engine_matches_transformers(moe_models, hf_greedy,
                                                                     name):
    prompts = _prompts(len(name))
    expected = hf_greedy(name, prompts)
    llm = LLM(str(moe_models[name]), dtype="float32", max_model_len=64, num_kv_blocks=10,
              max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=True)
    first = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in first] == expected
    assert llm.engine.get_stats().num_preemptions > 0
    again = llm.generate(prompts[:2], GREEDY)
    assert [o.outputs[0].token_ids for o in again] == expected[:2]
    assert all(o.num_cached_tokens >= 16 for o in again)
    assert_idle(llm.engine)
