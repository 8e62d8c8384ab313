"""Beam search against transformers' `generate(num_beams=W)` on a tiny random Llama, float32,
no EOS: the same sequences in the same order, scores within 1e-3."""

from __future__ import annotations

import random

import pytest

from pjinfer import LLM, BeamSearchParams
from pjinfer.beam_search import BeamSearch, BeamSearchSequence, beam_score
from pjinfer.outputs import Logprob
from tests.engine.idle import assert_idle

_rng = random.Random(7)
# Lengths around the 16-token block: full blocks of prompt + beam are prefix-cache hits.
PROMPTS = [[1] + [_rng.randrange(3, 128) for _ in range(n)] for n in (4, 22, 37)]
MAX_TOKENS = 8


def _hf_beams(model, prompt: list[int], width: int) -> tuple[list[list[int]], list[float]]:
    """transformers' beams (width 1 is its greedy search) and each one's summed log-probs,
    recomputed with a forward pass (and checked against its own beam scores)."""
    import torch

    out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                         do_sample=False, length_penalty=0.0, early_stopping=True,
                         max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         eos_token_id=None, pad_token_id=0, output_scores=True,
                         return_dict_in_generate=True)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(out.sequences).logits.float(), dim=-1)
    generated = out.sequences[:, len(prompt):]
    picked = logprobs[:, len(prompt) - 1:-1].gather(-1, generated[..., None])[..., 0]
    scores = picked.sum(-1).tolist()
    if width > 1:
        assert scores == pytest.approx(out.sequences_scores.tolist(), abs=1e-4)
    return generated.tolist(), scores


@pytest.fixture(scope="module")
def llm(hf_models) -> LLM:
    return LLM(str(hf_models["llama"]), dtype="float32", enable_prefix_caching=True)


@pytest.mark.parametrize("width", [1, 3, 4])
def test_matches_transformers(hf_models, llm, width):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_models["llama"]).eval()
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, ignore_eos=True,
                              length_penalty=0.0)
    outputs = llm.beam_search(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        sequences, scores = _hf_beams(model, prompt, width)
        assert [s.output_token_ids for s in out.sequences] == sequences
        assert [s.cum_logprob for s in out.sequences] == pytest.approx(scores, abs=1e-3)
        assert all(s.tokens[:len(prompt)] == prompt for s in out.sequences)
        assert all(s.finish_reason == "length" for s in out.sequences)
    assert_idle(llm.engine)
    assert llm.engine.get_stats().prefix_cache_hits > 0  # later steps reuse the beams' prefixes


def test_eos_beams_finish_and_length_penalty_ranks():
    """A candidate ending in EOS leaves the live beams; the final ranking divides by
    len ** length_penalty (prompt included, the EOS not counted), as vLLM does."""
    params = BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0)
    search = BeamSearch([[1, 5]], params, eos_token_id=2)

    def top(**lps: float):
        return {int(t[1:]): Logprob(v, rank) for rank, (t, v) in enumerate(lps.items(), 1)}

    search.advance([top(t2=-0.1, t7=-0.5, t8=-0.7, t9=-3.0)])
    assert search.requests() == [[1, 5, 7], [1, 5, 8]]  # EOS left the beams
    search.advance([top(t3=-0.2, t4=-2.0), top(t3=-0.1, t4=-2.5)])
    search.advance([top(t3=-0.1), top(t3=-0.1)])
    (out,) = search.results(decode=None)
    got = [(s.output_token_ids, s.finish_reason) for s in out.sequences]
    # [2] scores -0.1 / 2 = -0.05; [7,3,3] -0.8 / 5 = -0.16; [8,3,3] -0.9 / 5 = -0.18
    assert got == [([2], "stop"), ([7, 3, 3], "length")]
    seq = BeamSearchSequence([1, 5, 2], cum_logprob=-0.1, num_prompt_tokens=2)
    assert beam_score(seq, 2, 1.0) == pytest.approx(-0.05)


def test_bad_params_are_named(llm):
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=-1)
    with pytest.raises(ValueError, match="max_logprobs is 20"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
