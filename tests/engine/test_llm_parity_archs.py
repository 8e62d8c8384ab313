"""GPT-2 and Phi-3 through the engine (paged, batched, chunked, preempted) equal transformers.

Phi-3's LongRoPE variant has original_max_position_embeddings 64: an engine serving more than
64 tokens rotates with the long factors, which transformers also uses once a sequence is past
64 tokens, so those runs use prompts longer than 64; with max_model_len 64 both use the short
factors (transformers would switch mid-generation, which no paged cache can follow).
"""

from __future__ import annotations

import random

import pytest

from pjinfer import LLM, SamplingParams
from tests.engine.idle import assert_idle

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(seed: int, count: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 128) for _ in range(rng.randrange(*lengths))]
            for _ in range(count)]


SHORT = (1, 30)  # prompt + 32 tokens fit max_model_len 64
LONG = (65, 90)  # past Phi-3's original 64 positions from the first token on


@pytest.fixture(scope="module")
def hf_greedy(hf_models):
    """(variant, prompt) -> transformers' greedy continuation, memoised."""
    import torch
    import transformers

    models: dict[str, object] = {}
    cache: dict[tuple, list[int]] = {}

    def greedy(name: str, prompt: list[int]) -> list[int]:
        if name not in models:
            models[name] = transformers.AutoModelForCausalLM.from_pretrained(
                hf_models[name], dtype=torch.float32).eval()
        key = (name, tuple(prompt))
        if key not in cache:
            out = models[name].generate(torch.tensor([prompt]), do_sample=False,
                                        max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                        eos_token_id=None, pad_token_id=0)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key]

    return greedy


def _check(llm: LLM, name: str, prompts, hf_greedy) -> None:
    for prompt, out in zip(prompts, llm.generate(prompts, GREEDY), strict=True):
        assert out.outputs[0].token_ids == hf_greedy(name, prompt), (name, prompt)
    assert_idle(llm.engine)


@pytest.mark.parametrize("name, lengths", [("gpt2", SHORT), ("gpt2_relu", SHORT),
                                           ("phi3", LONG), ("phi3_sw", SHORT)])
def test_default_settings(hf_models, hf_greedy, name, lengths):
    llm = LLM(str(hf_models[name]), dtype="float32")
    _check(llm, name, _prompts(0, 6, lengths), hf_greedy)


def test_phi3_short_factors_below_original_length(hf_models, hf_greedy):
    llm = LLM(str(hf_models["phi3"]), dtype="float32", max_model_len=64)
    _check(llm, "phi3", _prompts(1, 6, SHORT), hf_greedy)


@pytest.mark.parametrize("name, lengths", [("gpt2", SHORT), ("phi3", LONG)])
def test_chunked_prefill_with_16_token_budget(hf_models, hf_greedy, name, lengths):
    llm = LLM(str(hf_models[name]), dtype="float32", max_num_batched_tokens=16,
              max_num_seqs=4)
    _check(llm, name, _prompts(2, 6, lengths), hf_greedy)


@pytest.mark.parametrize("name", ["gpt2", "phi3", "phi3_sw"])
def test_preemption_keeps_outputs_identical(hf_models, hf_greedy, name):
    llm = LLM(str(hf_models[name]), dtype="float32", max_model_len=64, num_kv_blocks=10)
    _check(llm, name, _prompts(3, 8, SHORT), hf_greedy)
    assert llm.engine.get_stats().num_preemptions > 0
