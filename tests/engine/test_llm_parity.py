"""Engine outputs (paged, batched, chunked, preempted, prefix-cached, n>1) equal transformers."""

from __future__ import annotations

import random

import pytest

from pjinfer import LLM, SamplingParams
from tests.engine.idle import assert_idle

NUM_PROMPTS, MAX_TOKENS = 24, 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(seed: int = 0, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = shared_prefix or []
    return [[1] + prefix + [rng.randrange(3, 128) for _ in range(rng.randrange(1, 40))]
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def hf_reference(hf_models):
    """Greedy continuations from transformers, memoised per prompt."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"]).eval()
    cache: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in cache:
            out = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return greedy


def _check(llm: LLM, prompts, hf_reference, params=GREEDY):
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_reference(prompt)
        for completion in out.outputs:
            assert completion.token_ids == expected
            assert completion.finish_reason == "length"
    assert_idle(llm.engine)
    return outputs


def test_default_settings(hf_models, hf_reference):
    llm = LLM(str(hf_models["llama"]), max_model_len=128)
    _check(llm, _prompts(0), hf_reference)


def test_cuda_graph_sizes(hf_models, hf_reference):
    """Steps padded to 2 and 4 sequences (and the widest, 8) instead of 8: same tokens."""
    llm = LLM(str(hf_models["llama"]), max_model_len=128, max_num_seqs=8,
              cuda_graph_sizes=[2, 4])
    _check(llm, _prompts(0), hf_reference)


def test_preemption_keeps_outputs_identical(hf_models, hf_reference):
    llm = LLM(str(hf_models["llama"]), max_model_len=64, num_kv_blocks=12)
    _check(llm, _prompts(1), hf_reference)
    assert llm.engine.get_stats().num_preemptions > 0


def test_chunked_prefill_with_16_token_budget(hf_models, hf_reference):
    llm = LLM(str(hf_models["llama"]), max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=8)
    _check(llm, _prompts(2), hf_reference)


def test_prefix_caching_hits_and_same_outputs(hf_models, hf_reference):
    llm = LLM(str(hf_models["llama"]), max_model_len=128, enable_prefix_caching=True)
    prompts = _prompts(3, shared_prefix=list(range(10, 50)))
    _check(llm, prompts[:4], hf_reference)
    _check(llm, prompts[4:], hf_reference)
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 20 * 32  # two full shared blocks per later prompt
    assert all(out.num_cached_tokens >= 32 for out in llm.generate(prompts[:2], GREEDY))


def test_n3_shares_prompt_blocks(hf_models, hf_reference):
    llm = LLM(str(hf_models["llama"]), max_model_len=128)
    outputs = _check(llm, _prompts(4)[:6], hf_reference,
                     SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS,
                                    ignore_eos=True))
    assert all(len(out.outputs) == 3 for out in outputs)


def test_n3_sampling_forks_and_frees(hf_models):
    llm = LLM(str(hf_models["llama"]), max_model_len=128)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=20, ignore_eos=True)
    (out,) = llm.generate([[1] + list(range(3, 40))], params)
    sequences = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(sequences)) == 3, "siblings must sample independently"
    assert_idle(llm.engine)
