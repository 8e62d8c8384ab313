"""Bad requests get OpenAI error JSON naming the problem, and never disturb the server."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest

from pjinfer.server import protocol
from tests.server.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Beautiful is"}
LONG_PROMPT = "Beautiful is better than ugly. " * 200
VOCAB = 512  # the demo model's vocabulary

# (path, body (dict, or raw bytes), status, words the message must contain, param)
BAD_REQUESTS = [
    ("/v1/completions", b"{not json", 400, "not valid JSON", None),
    ("/v1/completions", b"[1, 2]", 400, "JSON object", None),
    ("/v1/completions", {**COMPLETION, "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 1.5}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "x"}, 400, "model is required", "model"),
    ("/v1/completions", {**COMPLETION, "model": "gpt-4"}, 404, "does not exist", "model"),
    ("/v1/completions", {**COMPLETION, "prompt": LONG_PROMPT}, 400,
     "maximum context length", "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 100_000}, 400,
     "maximum context length", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {**COMPLETION, "top_p": -0.5}, 400, "top_p", "top_p"),
    ("/v1/completions", b'{"model": "pjinfer-demo", "prompt": "x", "temperature": NaN}', 400,
     "temperature", "temperature"),
    ("/v1/completions", {**COMPLETION, "n": 100_000}, 400, "n must be at most", "n"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "empty", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [10**9]}, 400, "token ids", "prompt"),
    ("/v1/completions", {**COMPLETION, "logprobs": 99}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {**COMPLETION, "stop": [""]}, 400, "stop", "stop"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias",
     "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "non-empty", "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "role", "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 3}]}, 400,
     "content", "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "logprobs", "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 5}, 400, "frequency_penalty",
     "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream", "stream"),
    # client mistakes that used to be 500s
    ("/v1/completions", {**COMPLETION, "prompt": [2**40]}, 400, "token ids", "prompt"),
    ("/v1/completions", b'{"model": "pjinfer-demo", "prompt": "a\\ud800b"}', 400,
     "lone surrogate", "prompt"),
    ("/v1/chat/completions", b'{"model": "pjinfer-demo", "messages": [{"role": "user", '
     b'"content": "\\ud800"}]}', 400, "lone surrogate", "messages[0].content"),
    ("/tokenize", b'{"prompt": "\\udfff"}', 400, "lone surrogate", "prompt"),
    ("/v1/completions", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000, 400, "nests JSON deeper",
     None),
    ("/v1/completions", b'{"a": ' * 65 + b"1" + b"}" * 65, 400, "nests JSON deeper", None),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [VOCAB]}, 400, "vocab_size",
     "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {str(VOCAB): 1}}, 400, "vocab_size",
     "logit_bias"),
    # vLLM's request extras
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": []}, 400, "not be empty",
     "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": [VOCAB]}, 400, "vocab_size",
     "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "allowed_token_ids": "7"}, 400, "an array",
     "allowed_token_ids"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 0}, 400, ">= 1",
     "truncate_prompt_tokens"),
    ("/v1/completions", {**COMPLETION, "truncate_prompt_tokens": 10**6}, 400,
     "at most max_model_len", "truncate_prompt_tokens"),
    ("/v1/completions", {**COMPLETION, "bad_words": "ugly"}, 400, "an array", "bad_words"),
    ("/v1/completions", {**COMPLETION, "bad_words": [""]}, 400, "non-blank", "bad_words"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": ["x"]}, 400, "an object",
     "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": True}}, 400,
     "may not set tokenize", "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True}, 400,
     "cannot both be true", "add_generation_prompt"),
    ("/v1/chat/completions", {**CHAT, "continue_final_message": True,
                              "add_generation_prompt": False}, 400, "assistant's",
     "continue_final_message"),
]
# values the sampler's int32/float32 device arrays cannot hold: the engine thread died on them
DEVICE_RANGE = [
    ({"top_k": 2**31}, "top_k"), ({"temperature": 1e39}, "temperature"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"), ({"min_tokens": 2**31}, "min_tokens"),
    ({"max_tokens": 2**40}, "max_tokens"), ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"logit_bias": {str(2**40): 1}}, "logit_bias"), ({"seed": 2**64}, "seed"),
]


@pytest.mark.parametrize(("path", "body", "status", "words", "param"), BAD_REQUESTS,
                         ids=[f"{i}-{b[0].split('/')[-1]}" for i, b in enumerate(BAD_REQUESTS)])
def test_bad_request(live_server, path, body, status, words, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = live_server.post(path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"]
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_server_keeps_serving_after_bad_requests(live_server):
    for path, body, *_ in BAD_REQUESTS[:6]:
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        live_server.post(path, **kwargs)
    r = live_server.client().completions.create(model=MODEL, prompt="Beautiful is better than",
                                                max_tokens=2, temperature=0)
    assert r.choices[0].text.startswith(" u")
    assert httpx.get(live_server.base_url + "/health").status_code == 200


@pytest.mark.parametrize(("fields", "param"), DEVICE_RANGE, ids=[p for _, p in DEVICE_RANGE])
def test_device_range_is_checked_and_the_engine_survives(live_server, fields, param):
    r = live_server.post("/v1/completions", json={**COMPLETION, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    chat = live_server.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, **fields})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == param
    ok = live_server.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    assert httpx.get(live_server.base_url + "/health").status_code == 200


def test_internal_fault_is_a_logged_json_500(live_server, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("formatting bug")

    monkeypatch.setattr(protocol, "completion_response", broken)
    with caplog.at_level(logging.ERROR, logger="pjinfer.server"):
        r = live_server.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "server_error" and "formatting bug" in error["message"]
    request_id = error["message"].rsplit("(request ", 1)[1].rstrip(")")
    failures = [rec for rec in caplog.records if "failed" in rec.getMessage()]
    assert len(failures) == 1 and request_id in failures[0].getMessage()
    assert failures[0].exc_info is not None


def test_openai_client_raises_typed_errors(live_server):
    client = live_server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": LONG_PROMPT}])


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": "test-key"}])
def test_auth_required_on_v1(live_server, headers):
    r = httpx.get(live_server.base_url + "/v1/models", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_openai_client_with_a_wrong_key(live_server):
    client = openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="wrong",
                           max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
