"""`pjinfer.LLM(..., tensor_parallel_size=tp)` end to end: the same greedy tokens as tp=1."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pjinfer
from pjinfer import SamplingParams

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 100, 7], [1, 64, 3, 90, 12, 44, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
_TOKENS: dict[tuple, list[list[int]]] = {}


def _generate(path, tp: int, **kwargs) -> list[list[int]]:
    key = (str(path), tp, tuple(sorted(kwargs.items())))
    if key not in _TOKENS:
        llm = pjinfer.LLM(str(path), tensor_parallel_size=tp, dtype="float32",
                          max_num_seqs=8, max_num_batched_tokens=64, **kwargs)
        _TOKENS[key] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    return _TOKENS[key]


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_greedy_tokens_match_tp1(gqa8_model, tp):
    expected = _generate(gqa8_model, 1)
    assert all(len(t) == GREEDY.max_tokens for t in expected)
    assert _generate(gqa8_model, tp) == expected


def test_multi_step_decode_under_tp(gqa8_model):
    """Several decode steps per call (num_scheduler_steps) on a sharded cache: tp=1's tokens."""
    llm = pjinfer.LLM(str(gqa8_model), tensor_parallel_size=2, dtype="float32",
                      max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=5)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert llm.engine.runner._multi._compiled, "the multi-step decode never ran"
    assert tokens == _generate(gqa8_model, 1)


@pytest.mark.parametrize("name", ["gpt2", "gpt2_relu", "phi3", "phi3_sw"])
def test_other_architectures_match_tp1(hf_models, name):
    """GPT-2 (split c_attn, LayerNorm biases, learned positions, per-layer scale) and Phi-3
    (split qkv/gate_up, LongRoPE, sliding window) shard with Llama's rules."""
    expected = _generate(hf_models[name], 1)
    assert _generate(hf_models[name], 2) == expected


def test_chunked_prefill_and_prefix_cache_under_tp(gqa8_model):
    """Chunks of 16 tokens and copy-on-write/prefix hits run through the sharded cache."""
    kwargs = dict(max_num_batched_tokens=16, enable_prefix_caching=True)
    llm = pjinfer.LLM(str(gqa8_model), tensor_parallel_size=4, dtype="float32",
                      max_num_seqs=4, **kwargs)
    long = PROMPTS[0] * 3
    first = llm.generate([long], GREEDY)[0].outputs[0].token_ids
    again = llm.generate([long], GREEDY)[0]
    assert again.outputs[0].token_ids == first and again.num_cached_tokens > 0
    ref = pjinfer.LLM(str(gqa8_model), dtype="float32", max_num_seqs=4, **kwargs)
    assert ref.generate([long], GREEDY)[0].outputs[0].token_ids == first


def test_runner_holds_sharded_weights_and_cache(gqa8_model):
    """Dummy weights too are made on the mesh (their values: test_mesh_and_rules)."""
    llm = pjinfer.LLM(str(gqa8_model), tensor_parallel_size=8, dtype="float32",
                      load_format="dummy")
    runner = llm.engine.runner
    q = runner.params["layers"][0]["q_proj"]  # [64, 8 heads x 8]
    assert q.sharding.spec == P(None, "tp") and q.addressable_shards[0].data.shape == (64, 8)
    k_cache = runner.kv_caches[0][0]  # [NB, bs, 8 layout kv heads, hd]: one head per device
    assert k_cache.shape[2] == 8 and k_cache.addressable_shards[0].data.shape[2] == 1
    assert {s.device for s in k_cache.addressable_shards} == set(jax.devices())


def test_demo_model_text_matches_tp1():
    """The embedded demo model (4 heads, 2 kv heads), prompts as text, through the tokenizer."""
    outs = {}
    for tp in (1, 2):
        llm = pjinfer.LLM(None, tensor_parallel_size=tp, max_num_seqs=8,
                          max_num_batched_tokens=64)
        outs[tp] = [o.outputs[0].text for o in llm.generate(["Hello", "The sky is"], GREEDY)]
    assert outs[2] == outs[1] and all(outs[1])


def test_explicit_params_are_sharded_by_the_engine(gqa8_model):
    from pjinfer.engine.config import EngineConfig
    from pjinfer.engine.engine import LLMEngine
    from pjinfer.weights import load_model

    _, params = load_model(gqa8_model, dtype="float32")
    engine = LLMEngine(EngineConfig(model=str(gqa8_model), tensor_parallel_size=2,
                                    dtype="float32", warmup=False), params=params)
    v = engine.runner.params["layers"][1]["v_proj"]
    assert v.sharding.spec == P(None, "tp")
    np.testing.assert_array_equal(np.asarray(v), np.asarray(params["layers"][1]["v_proj"]))
