"""Every architecture against Hugging Face transformers on random weights: logits, greedy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pjinfer.models.dense import dense_greedy_generate, dense_logits
from pjinfer.weights import load_model
from tests.conftest import MODEL_VARIANTS

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [1, 100, 7], [1, 64, 3, 90, 12, 44, 8]]


def _pad(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    ids = np.zeros((len(prompts), width), np.int32)
    for row, p in zip(ids, prompts, strict=True):
        row[: len(p)] = p
    return ids, np.array([len(p) for p in prompts], np.int32)


def _hf_logits(path, prompts, dtype):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0].float().numpy() for p in prompts], model


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("name", list(MODEL_VARIANTS))
def test_float32_logits_and_greedy_match_transformers(hf_models, name):
    import torch

    path = hf_models[name]
    cfg, params = load_model(path, dtype="float32")
    ids, lengths = _pad(PROMPTS)
    ours = np.asarray(dense_logits(params, cfg, jnp.asarray(ids), jnp.asarray(lengths)))
    theirs, model = _hf_logits(path, PROMPTS, torch.float32)
    for i, ref in enumerate(theirs):
        assert _rel_err(ours[i, : lengths[i]], ref) < 1e-4, (name, i)

    hf_tokens = model.generate(torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=32,
                               min_new_tokens=32, eos_token_id=None, pad_token_id=0)
    expected = hf_tokens[0, len(PROMPTS[0]):].tolist()
    assert dense_greedy_generate(params, cfg, PROMPTS[0], 32) == expected


@pytest.mark.parametrize("name", ["llama", "qwen3", "gpt2", "phi3"])
def test_bfloat16_logits_match_transformers(hf_models, name):
    import torch

    path = hf_models[name]
    cfg, params = load_model(path, dtype="bfloat16")
    assert params["layers"][0]["q_proj"].dtype == jnp.bfloat16
    ids, lengths = _pad(PROMPTS)
    ours = np.asarray(dense_logits(params, cfg, jnp.asarray(ids), jnp.asarray(lengths)))
    theirs, _ = _hf_logits(path, PROMPTS, torch.bfloat16)
    for i, ref in enumerate(theirs):
        # bf16 keeps 8 mantissa bits; two layers of independent rounding stay within a few %.
        assert _rel_err(ours[i, : lengths[i]], ref) < 3e-2, (name, i)


def test_sliding_window_is_used_by_mistral_and_switched_off_for_qwen2(hf_models):
    mistral, _ = load_model(hf_models["mistral"], load_format="dummy")
    qwen2, _ = load_model(hf_models["qwen2"], load_format="dummy")
    assert mistral.sliding_windows == (6, 6)
    assert qwen2.sliding_window(0) is None
