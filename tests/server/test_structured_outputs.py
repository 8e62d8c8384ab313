"""Structured outputs through the OpenAI API: the official client's `parse()` with a Pydantic
model, `json_object`, vLLM's `structured_outputs` and `guided_*` fields, and 400s naming the
field for every bad constraint, after which the server keeps serving with no KV block held."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Beautiful is"}]}
COMPLETION = {"model": MODEL, "prompt": "Beautiful is better than"}


class ZenLine(BaseModel):
    adjective: str = Field(max_length=10)
    count: int = Field(ge=0, le=99)
    beautiful: bool


def test_parse_returns_the_pydantic_object(live_server):
    completion = live_server.client().chat.completions.parse(
        model=MODEL, messages=CHAT["messages"], response_format=ZenLine, max_tokens=80,
        temperature=0)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, ZenLine)
    assert ZenLine.model_validate_json(message.content) == message.parsed


def test_json_object_returns_json(live_server):
    completion = live_server.client().chat.completions.create(
        model=MODEL, messages=CHAT["messages"], response_format={"type": "json_object"},
        max_tokens=80, temperature=1.0, seed=7, n=8)
    stopped = [c for c in completion.choices if c.finish_reason == "stop"]
    assert stopped, "some of 8 samples should close their object within 80 tokens"
    for choice in stopped:
        assert isinstance(json.loads(choice.message.content), dict)
    for choice in completion.choices:  # cut by max_tokens: still a JSON object's start
        assert choice.message.content.startswith("{")


def test_streamed_json_schema_joins_to_a_valid_object(live_server):
    schema = {**ZenLine.model_json_schema(), "additionalProperties": False}
    stream = live_server.client().chat.completions.create(
        model=MODEL, messages=CHAT["messages"], max_tokens=80, temperature=1.0, seed=5,
        stream=True, response_format={"type": "json_schema", "json_schema": {
            "name": "zen", "schema": schema, "strict": True}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop", text
    ZenLine.model_validate_json(text)


@pytest.mark.parametrize(("extra", "check"), [
    ({"structured_outputs": {"choice": [" ugly.", " pretty."]}},
     lambda t: t in (" ugly.", " pretty.")),
    ({"guided_regex": r" [a-z]{2,8}\."}, lambda t: re.fullmatch(r" [a-z]{2,8}\.", t)),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_json": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                      "required": ["n"], "additionalProperties": False}},
     lambda t: json.loads(t)["n"] <= 9),
    ({"guided_grammar": 'start: "Zen" DIGIT\nDIGIT: /[0-9]/\n'},
     lambda t: re.fullmatch(r"Zen[0-9]", t)),
    ({"response_format": {"type": "text"}}, lambda t: True),
], ids=["structured_outputs", "guided_regex", "guided_choice", "guided_json", "guided_grammar",
        "text"])
def test_vllm_fields_constrain_completions(live_server, extra, check):
    completion = live_server.client().completions.create(
        model=MODEL, prompt=COMPLETION["prompt"], max_tokens=40, temperature=1.0, seed=3, n=4,
        extra_body=extra)
    for choice in completion.choices:
        assert check(choice.text), choice.text
        assert choice.finish_reason == ("length" if "response_format" in extra else "stop")


def _json_schema(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}}


BAD = [  # (path, extra body fields, param, words in the message)
    ("/v1/chat/completions", _json_schema({"type": "nope"}), "response_format",
     "response_format.json_schema.schema is not a valid JSON schema"),
    ("/v1/chat/completions", _json_schema({"type": "array", "uniqueItems": True}),
     "response_format", "unsupported JSON schema keyword"),
    ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs",
     "structured_outputs.regex is not a valid regex"),
    ("/v1/completions", {"guided_grammar": "start: foo"}, "guided_grammar",
     "guided_grammar is not a valid grammar"),
    ("/v1/completions", {"guided_json": "{oops"}, "guided_json", "guided_json is not valid JSON"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs", "exactly one of"),
    ("/v1/completions", {"structured_outputs": {"xml": "a"}}, "structured_outputs",
     "structured_outputs.xml is not supported"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                              "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "response_format and structured_outputs both constrain"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format",
     "json_schema must be an object with a schema"),
]


@pytest.mark.parametrize(("path", "extra", "param", "words"), BAD,
                         ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_constraint_is_400_naming_the_field(live_server, path, extra, param, words):
    body = {**(CHAT if "chat" in path else COMPLETION), "max_tokens": 5, **extra}
    for stream in (False, True):
        r = live_server.post(path, json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    ok = live_server.post("/v1/completions", json={**COMPLETION, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"]
    assert live_server.wait_idle()["pjinfer:kv_blocks_used"] == 0
