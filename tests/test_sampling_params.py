"""SamplingParams: bad user input is refused with a message naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pjinfer.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 4.0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be <= max_tokens"),
    ({"n": 0}, "n must be in"),
    ({"n": 10_000}, "n must be in"),
    ({"n": True}, "n must be an int"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"stop": 5}, "stop must be a string or a list of strings"),
    ({"stop": ["ok", 3]}, "stop must be a string or a list of strings"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": 7}, "stop_token_ids"),
    ({"logit_bias": {3: math.inf}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"logit_bias": {"3": 1.0}}, "logit_bias"),
    ({"logit_bias": [1.0]}, "logit_bias"),
    ({"seed": 1.5}, "seed"),
    ({"seed": False}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
    # what the sampler's int32/float32 device arrays cannot hold
    ({"top_k": 2**31}, "top_k must be at most 2147483647"),
    ({"max_tokens": 2**31}, "max_tokens must be at most"),
    ({"min_tokens": 2**40}, "min_tokens must be at most"),
    ({"temperature": 1e39}, "temperature must be a finite number (float32"),
    ({"top_p": 1e-50}, "top_p must be in (0, 1]"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty must be > 0"),
    ({"repetition_penalty": 1e39}, "repetition_penalty"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids must be a list of token ids in [0, 2**31)"),
    ({"logit_bias": {2**31: 1.0}}, "logit_bias keys must be token ids in [0, 2**31)"),
    ({"logit_bias": {3: 1e39}}, "logit_bias value for token 3"),
    ({"seed": 2**64}, "seed"),
    # vLLM's allowed_token_ids and truncate_prompt_tokens
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [3, -1]}, "allowed_token_ids must be a list of token ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids must be a list of token ids"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be >= 1"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be >= 1"),
    ({"truncate_prompt_tokens": 2.5}, "truncate_prompt_tokens must be an int"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[str(k) for k, _ in INVALID])
def test_invalid_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert message in str(err.value)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == () and p.stop_token_ids == () and p.logit_bias is None
    assert p.skip_special_tokens and not p.ignore_eos and not p.greedy


def test_normalisation_freezes_user_containers() -> None:
    stops, bias = ["a", "bc"], {5: 1.5}
    p = SamplingParams(stop=stops, stop_token_ids=[7, 9], logit_bias=bias, top_k=-1)
    stops.append("zzz")
    bias[6] = 2.0
    assert p.stop == ("a", "bc") and p.stop_token_ids == (7, 9)
    assert p.logit_bias == {5: 1.5}
    assert p.top_k == 0
    assert SamplingParams(stop="END").stop == ("END",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_valid_params_round_trip() -> None:
    p = SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.2, seed=2**40, stop=["\n\n"],
        stop_token_ids=[2], max_tokens=None, min_tokens=3, logprobs=0, prompt_logprobs=5,
        logit_bias={1: -100.0}, include_stop_str_in_output=True,
    )
    assert SamplingParams(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}) == p
    assert p.uses_penalties and not p.greedy


def test_greedy_threshold_follows_vllm() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-3).greedy


def test_check_vocab_rejects_out_of_range_ids() -> None:
    SamplingParams(stop_token_ids=[99], logit_bias={50: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="^logit_bias token ids must be < vocab_size=100"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="^stop_token_ids token ids must be < vocab_size=100"):
        SamplingParams(stop_token_ids=[100]).check_vocab(100)


def test_allowed_token_ids_are_frozen_and_range_checked() -> None:
    ids = [9, 4, 9]
    p = SamplingParams(allowed_token_ids=ids)
    ids.append(1)
    assert p.allowed_token_ids == (9, 4) and SamplingParams().allowed_token_ids is None
    p.check_vocab(10)
    with pytest.raises(ValueError, match="^allowed_token_ids token ids must be < vocab_size=9"):
        p.check_vocab(9)


def test_truncate_keeps_the_last_tokens_as_vllm() -> None:
    ids = list(range(10))
    assert SamplingParams().truncate(ids, 64) == ids
    assert SamplingParams(truncate_prompt_tokens=3).truncate(ids, 64) == [7, 8, 9]
    assert SamplingParams(truncate_prompt_tokens=30).truncate(ids, 64) == ids
    assert SamplingParams(truncate_prompt_tokens=-1).truncate(ids, 4) == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be at most"):
        SamplingParams(truncate_prompt_tokens=65).truncate(ids, 64)


def test_int32_and_float32_limits_are_accepted() -> None:
    p = SamplingParams(top_k=2**31 - 1, seed=2**64 - 1, stop_token_ids=[2**31 - 1],
                       logit_bias={2**31 - 1: 100.0}, temperature=3e38, max_tokens=2**31 - 1)
    assert p.top_k == 2**31 - 1 and p.seed == 2**64 - 1


def test_output_kind_must_be_the_enum():
    from pjinfer import RequestOutputKind

    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind.value == \
        "final_only"
    with pytest.raises(ValueError, match="RequestOutputKind.FINAL_ONLY"):
        SamplingParams(output_kind="final")
