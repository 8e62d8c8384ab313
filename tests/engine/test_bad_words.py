"""vLLM's bad_words: token sequences of each word (plain and space-prefixed), the tokens a
step bans, and the engine's greedy output against an oracle that bans them by hand."""

from __future__ import annotations

import numpy as np
import pytest

from pjinfer import LLM, SamplingParams
from pjinfer.engine.bad_words import bad_words_token_ids, banned_tokens
from pjinfer.engine.sampling_metadata import SamplingMetadata, SamplingRow
from tests.engine.idle import assert_idle


class WordTokenizer:
    """Each character one token (its ord), except that a leading space joins the next
    character: enough to tell the plain and the spaced form apart."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                ids.append(1000 + ord(text[i + 1]))
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids


def test_words_become_plain_and_spaced_sequences():
    seqs = bad_words_token_ids(["ab", "  c", "ab"], WordTokenizer())
    a, b, c = ord("a"), ord("b"), ord("c")
    assert seqs == ((a, b), (1000 + a, b), (c,), (1000 + c,))


@pytest.mark.parametrize(("output", "banned"), [
    ([], [9]),  # a one-token word is always banned; the two-token one needs its head
    ([5, 1], [9, 2]),
    ([1], [9, 2]),
    ([1, 5], [9]),
    ([7, 1, 2], [9, 3]),  # the three-token word's head [1, 2] just completed
])
def test_banned_tokens_complete_no_word(output, banned):
    assert banned_tokens([(9,), (1, 2), (1, 2, 3)], output) == banned


def test_bans_reach_the_step_suppression_table():
    params = SamplingParams(bad_words=["x"])
    row = SamplingRow(params, [1], [4, 1], 0, bad_words=((9,), (1, 2)))
    md = SamplingMetadata.build([row, SamplingRow(SamplingParams(), [1], [], 0)], 2)
    assert sorted(np.asarray(md.suppress_token_ids)[0][:2].tolist()) == [2, 9]
    assert (np.asarray(md.suppress_token_ids)[1] < 0).all()


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM()


def test_engine_greedy_never_completes_a_bad_word(demo):
    """The demo model's greedy line is " ugly.\\nExplicit is better than implicit.": banning
    "ugly" and "implicit" changes it exactly where an oracle (greedy over the raw logits with
    those sequences' last tokens removed by hand, step by step) says."""
    prompt = "Beautiful is better than"
    words = ["ugly", "implicit"]
    params = SamplingParams(temperature=0, max_tokens=16, bad_words=words)
    out = demo.generate(prompt, params)[0].outputs[0]
    plain = demo.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    assert "ugly" in plain.outputs[0].text and "ugly" not in out.text
    seqs = bad_words_token_ids(words, demo.tokenizer)
    ids = demo.tokenizer.encode(prompt)
    expected: list[int] = []
    for _ in range(16):  # the oracle: one token a step, the bans applied to its logprobs
        scores = demo.generate({"prompt_token_ids": ids + expected},
                               SamplingParams(temperature=0, max_tokens=1, logprobs=20)
                               )[0].outputs[0].logprobs[0]
        ranked = sorted(scores, key=lambda t: scores[t].rank)
        ban = set(banned_tokens(seqs, expected))
        expected.append(next(t for t in ranked if t not in ban))
    assert out.token_ids == expected
    with pytest.raises(ValueError, match="bad_words must be a list of words"):
        SamplingParams(bad_words=["ok", "  "])
    assert_idle(demo.engine)
