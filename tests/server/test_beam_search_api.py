"""`use_beam_search` through the openai client: the same beams as the offline `LLM.beam_search`
on the demo model, in OpenAI's response shape, and 400s naming the fields it cannot take."""

from __future__ import annotations

import openai
import pytest

from pjinfer import LLM, BeamSearchParams
from pjinfer.tokenizer import apply_chat_template
from tests.server.conftest import MODEL

PROMPT = "Beautiful is better than"
MESSAGES = [{"role": "user", "content": "What is the Zen of Python?"}]


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(None, enable_prefix_caching=True)


def _offline_beams(llm: LLM, prompt, width: int, max_tokens: int, length_penalty: float):
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              length_penalty=length_penalty)
    out = llm.beam_search([prompt], params)[0]
    texts = [llm.tokenizer.decode(s.output_token_ids, skip_special_tokens=True)
             for s in out.sequences]
    return texts, [s.finish_reason for s in out.sequences], \
        sum(len(s.output_token_ids) for s in out.sequences)


@pytest.mark.parametrize(("width", "length_penalty"), [(2, 1.0), (3, 0.5)])
def test_completions_beams_match_offline(live_server, offline, width, length_penalty):
    response = live_server.client().completions.create(
        model=MODEL, prompt=PROMPT, n=width, max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty})
    texts, reasons, completion_tokens = _offline_beams(offline, PROMPT, width, 8,
                                                       length_penalty)
    assert [c.index for c in response.choices] == list(range(width))
    assert [c.text for c in response.choices] == texts  # best first, generated part only
    assert [c.finish_reason for c in response.choices] == reasons
    assert response.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert response.usage.completion_tokens == completion_tokens
    m = live_server.wait_idle()
    assert m["pjinfer:num_requests_running"] == m["pjinfer:kv_blocks_used"] == 0


def test_chat_beams_match_offline(live_server, offline):
    response = live_server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, n=2, max_tokens=10,
        extra_body={"use_beam_search": True})
    prompt = apply_chat_template(offline.tokenizer, MESSAGES)
    texts, reasons, completion_tokens = _offline_beams(offline, prompt, 2, 10, 1.0)
    assert [c.message.content for c in response.choices] == texts
    assert [c.finish_reason for c in response.choices] == reasons
    assert response.usage.completion_tokens == completion_tokens
    assert response.object == "chat.completion"


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"n": 11}, "n", "max_logprobs is 20"),
    ({"n": 2, "stream": True}, "stream", "stream is not supported with use_beam_search"),
    ({"n": 2, "top_p": 0.5}, "top_p", "top_p is not supported"),
    ({"n": 2, "logprobs": 2}, "logprobs", "logprobs is not supported"),
    ({"n": 2, "allowed_token_ids": [5]}, "allowed_token_ids",
     "allowed_token_ids is not supported"),
    ({"n": 2, "bad_words": ["ugly"]}, "bad_words", "bad_words is not supported"),
    ({"best_of": 3}, "best_of", "best_of must be null or equal to n"),
    ({"n": 2, "length_penalty": "long"}, "length_penalty", "length_penalty must be a number"),
])
def test_bad_beam_requests_name_the_field(live_server, extra, param, words):
    r = live_server.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                  "max_tokens": 4, "use_beam_search": True,
                                                  **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_without_use_beam_search_n_samples_as_before(live_server):
    client = live_server.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4, stream=True,
                                  extra_body={"use_beam_search": True})
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=4,
                                         temperature=0, extra_body={"length_penalty": 2.0})
    assert len(response.choices) == 2 and response.choices[0].text == response.choices[1].text
