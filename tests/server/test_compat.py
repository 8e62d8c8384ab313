"""Client compatibility: OpenAI-shaped 404/405, model retrieval, fields refused while not
implemented, vLLM's request extras, echo offsets and prompt scoring, vLLM's model_name metric
label."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY, MODEL

PROMPT = "Beautiful is better than"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
COMPLETION = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_route_and_wrong_method_are_json(live_server):
    missing = httpx.get(live_server.base_url + "/v1/nope", headers=AUTH)
    assert "/v1/nope" in _error(missing, 404)["message"]
    wrong = httpx.get(live_server.base_url + "/v1/completions", headers=AUTH)
    assert _error(wrong, 405)["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "POST"


def test_retrieve_model(live_server):
    card = live_server.client().models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    r = httpx.get(live_server.base_url + "/v1/models/org/other-model", headers=AUTH)
    assert _error(r, 404)["code"] == "model_not_found"
    assert httpx.get(live_server.base_url + f"/v1/models/{MODEL}").status_code == 401


REFUSED = [
    ("/v1/completions", {**COMPLETION, "best_of": 2}, "best_of"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {**COMPLETION, "suffix": "!"}, "suffix"),
    ("/v1/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),  # without echo
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED, ids=[p for *_, p in REFUSED])
def test_unimplemented_fields_are_refused_by_name(live_server, path, body, param):
    assert _error(live_server.post(path, json=body), 400)["param"] == param


def test_unimplemented_fields_may_be_null(live_server):
    body = {**COMPLETION, "n": 2, "best_of": 2, "suffix": None, "response_format": None}
    assert live_server.post("/v1/completions", json=body).status_code == 200
    chat = {**CHAT, "tools": None, "best_of": None}
    assert live_server.post("/v1/chat/completions", json=chat).status_code == 200


def test_ignored_fields_are_logged_as_vllm_does(live_server, caplog):
    """A field no endpoint reads (a typo, another server's extra) is served without it and
    named in a warning; a request of known fields logs none."""
    with caplog.at_level(logging.WARNING, logger="pjinfer.server"):
        assert live_server.post("/v1/completions", json=COMPLETION).status_code == 200
        assert live_server.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {},
                                                              "max_completion_tokens": 2,
                                                              "top_k": 3}).status_code == 200
        assert not [r for r in caplog.records if "ignored" in r.getMessage()]
        r = live_server.post("/v1/completions", json={**COMPLETION, "temprature": 0.5,
                                                      "store": True})
    assert r.status_code == 200
    [warning] = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert warning.endswith("were present in the request but ignored: store, temprature")


def test_vllm_sampling_extras(live_server):
    """allowed_token_ids, truncate_prompt_tokens, add_special_tokens and bad_words through
    the openai client's extra_body: one allowed token is all a sampled completion can hold; a
    truncated prompt answers as its last tokens sent as the prompt; add_special_tokens: false
    drops BOS; the greedy " ugly" is never completed."""
    client = live_server.client()
    ids = live_server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, seed=1,
                                    extra_body={"allowed_token_ids": [ids[2]]})
    thrice = live_server.post("/detokenize", json={"tokens": [ids[2]] * 3}).json()["prompt"]
    assert one.choices[0].text == thrice
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3})
    direct = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=6,
                                       temperature=0)
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].text == direct.choices[0].text
    bare = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                     extra_body={"add_special_tokens": False})
    assert bare.usage.prompt_tokens == len(ids) - 1  # no BOS
    clean = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"bad_words": ["ugly"]})
    assert "ugly" not in clean.choices[0].text and clean.usage.completion_tokens == 8


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids(live_server, stream):
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (those the
    text came from), offsets still count the text; chat's bytes are the name's."""
    body = {**COMPLETION, "max_tokens": 4, "logprobs": 2, "echo": True, "stream": stream}

    def logprobs(r: httpx.Response) -> dict:
        if not stream:
            return r.json()["choices"][0]["logprobs"]
        parts = [json.loads(line[6:])["choices"][0]["logprobs"]
                 for line in r.text.split("\n") if line.startswith("data: {")]
        return {key: [v for p in parts if p for v in p[key]] for key in parts[0]}

    named = logprobs(live_server.post("/v1/completions",
                                      json={**body, "return_tokens_as_token_ids": True}))
    plain = logprobs(live_server.post("/v1/completions", json=body))
    ids = [int(t.removeprefix("token_id:")) for t in named["tokens"]]
    text = live_server.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert [t.startswith("token_id:") for t in named["tokens"]] == [True] * len(ids)
    assert text == "".join(plain["tokens"])  # the echoed prompt (BOS first) and the output
    assert named["text_offset"] == plain["text_offset"]
    assert all(k.startswith("token_id:") for top in named["top_logprobs"] if top for k in top)
    chat = live_server.post("/v1/chat/completions", json={
        **CHAT, "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": True}
    ).json()["choices"][0]["logprobs"]["content"]
    assert chat and all(e["token"].startswith("token_id:") and
                        bytes(e["bytes"]).decode() == e["token"] for e in chat)


def test_chat_template_extras(live_server):
    """chat_template_kwargs reach the template (the demo's takes no variables: same answer);
    continue_final_message lets the model go on with the assistant's words."""
    client = live_server.client()
    plain = client.chat.completions.create(**{**CHAT, "temperature": 0, "max_tokens": 6})
    kwargs = client.chat.completions.create(**{**CHAT, "temperature": 0, "max_tokens": 6},
                                            extra_body={"chat_template_kwargs":
                                                        {"enable_thinking": False}})
    assert kwargs.choices[0].message.content == plain.choices[0].message.content
    messages = [{"role": "user", "content": "What is the Zen of Python?"},
                {"role": "assistant", "content": "Beautiful is"}]
    went_on = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=6,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert went_on.choices[0].message.content.startswith(" better than")


def _check_offsets(text: str, logprobs: dict) -> None:
    """Each token's text sits at its offset in the choice's text; BOS has none."""
    assert logprobs["tokens"][0] == "<s>" and logprobs["text_offset"][:2] == [0, 0]
    for token, offset in zip(logprobs["tokens"][1:], logprobs["text_offset"][1:], strict=True):
        assert text[offset:offset + len(token)] == token


def test_echo_text_offsets_skip_bos(live_server):
    r = live_server.post("/v1/completions", json={**COMPLETION, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    _check_offsets(choice["text"], choice["logprobs"])


def test_streamed_echo_text_offsets_skip_bos(live_server):
    body = {**COMPLETION, "echo": True, "logprobs": 1, "stream": True, "max_tokens": 4}
    with httpx.stream("POST", live_server.base_url + "/v1/completions", json=body,
                      headers=AUTH, timeout=60) as r:
        chunks = [json.loads(line[6:])["choices"][0]
                  for line in r.iter_lines() if line.startswith("data: {")]
    text = "".join(c["text"] for c in chunks)
    merged = {key: [v for c in chunks for v in c["logprobs"][key]]
              for key in ("tokens", "text_offset")}
    _check_offsets(text, merged)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(live_server, stream):
    r = live_server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=0,
                                                echo=True, logprobs=1, stream=stream)
    choices = [c for chunk in r for c in chunk.choices] if stream else r.choices
    assert "".join(c.text for c in choices) == PROMPT
    assert choices[-1].finish_reason == "length"
    tokens = [t for c in choices for t in c.logprobs.tokens]
    logprobs = [lp for c in choices for lp in c.logprobs.token_logprobs]
    assert "".join(tokens[1:]) == PROMPT
    assert logprobs[0] is None and all(lp <= 0 for lp in logprobs[1:])
    if not stream:
        assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(tokens)


def test_every_metric_has_the_model_name_label(live_server):
    live_server.post("/v1/completions", json=COMPLETION)
    text = httpx.get(live_server.base_url + "/metrics").text
    samples = [s for family in text_string_to_metric_families(text)
               if family.name.startswith("pjinfer:") for s in family.samples]
    assert len(samples) > 20
    assert all(s.labels.get("model_name") == MODEL for s in samples), [
        s.name for s in samples if s.labels.get("model_name") != MODEL]
