"""Tool calling through the OpenAI API with the official client: `tool_choice` required and
named (a grammar forces the calls), auto (the server's hermes parser reads them), whole and
streamed, a round trip with the tool's result sent back, and 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.server.conftest import MODEL

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}$"},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Beautiful is the weather in Paris?"}]
ARGS = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120,
        "temperature": 1.0, "seed": 4}
ONE = {**ARGS, "parallel_tool_calls": False}  # the demo model would go on calling forever


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _joined_stream(chunks: list) -> tuple[str, list[dict], str]:
    """(content, calls, finish reason) of streamed chunks, checking each delta's shape."""
    content, calls, reasons = "", [], []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasons.append(chunk.choices[0].finish_reason)
        for call in delta.tool_calls or []:
            if call.index == len(calls):  # the first delta: id, type and name
                assert call.id and call.type == "function" and call.function.name
                calls.append({"id": call.id, "name": call.function.name,
                              "arguments": call.function.arguments or ""})
            else:
                assert call.id is None and call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
    return content, calls, reasons[-1]


def test_required_round_trip(live_server):
    client = live_server.client()
    completion = client.chat.completions.create(**ONE, tool_choice="required")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather", "get_time"})
    call = choice.message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}
    history = [*MESSAGES, choice.message.model_dump(exclude_none=True), result]
    answer = client.chat.completions.create(**{**ARGS, "messages": history, "max_tokens": 8},
                                            tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    tokens = live_server.post("/tokenize", json={"model": MODEL, "messages": history})
    text = client.completions.create(model=MODEL, prompt=tokens.json()["tokens"],
                                     max_tokens=1, echo=True).choices[0].text
    assert "21 degrees and sunny" in text  # the tool's result reached the template


def test_required_streamed(live_server):
    chunks = list(live_server.client().chat.completions.create(
        **ONE, tool_choice="required", stream=True, logprobs=True,
        stream_options={"include_usage": True}))
    content, calls, reason = _joined_stream(chunks)
    assert content == "" and reason == "tool_calls" and len(calls) == 1
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs
                for lp in c.choices[0].logprobs.content]
    assert len(logprobs) == chunks[-1].usage.completion_tokens  # none lost while held back
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    whole = live_server.client().chat.completions.create(**ONE, tool_choice="required")
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message
            .tool_calls] == [(c["name"], c["arguments"]) for c in calls]  # same seed


def test_parallel_calls_stream_one_index_each(live_server):
    """Without parallel_tool_calls=false the demo model calls until max_tokens: each call
    streams under its own index; the cut-off one's arguments are what arrived."""
    stream = live_server.client().chat.completions.create(
        **{**ARGS, "max_tokens": 60}, tool_choice="required", stream=True)
    _, calls, reason = _joined_stream(list(stream))
    assert reason == "length" and len(calls) >= 2 and len({c["id"] for c in calls}) == \
        len(calls)
    for call in calls[:-1]:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_function(live_server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    client = live_server.client()
    completion = client.chat.completions.create(**ARGS, tool_choice=choice)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"  # OpenAI's, for a named function
    _check_calls(message.tool_calls, {"get_time"})
    assert len(message.tool_calls) == 1
    with client.chat.completions.stream(**ARGS, tool_choice=choice) as stream:
        final = stream.get_final_completion()  # the client's own joining of the deltas
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert call.function.arguments == message.tool_calls[0].function.arguments


REGEX = (r'Checking\.<tool_call>\{"name": "get_weather", "arguments": '
         r'\{"city": "[A-Z][a-z]{2,6}", "unit": "celsius"\}\}</tool_call>')


def test_auto_reads_calls_with_the_servers_parser(live_server):
    """The demo model knows no tools: a regex makes it write a hermes call, which the
    server's parser (hermes) turns into tool_calls; plain text stays content."""
    client = live_server.client()
    extra = {"structured_outputs": {"regex": REGEX}}
    completion = client.chat.completions.create(**ARGS, extra_body=extra)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content == "Checking."
    _check_calls(message.tool_calls, {"get_weather"})
    chunks = list(client.chat.completions.create(**ARGS, extra_body=extra, stream=True))
    content, calls, reason = _joined_stream(chunks)
    assert (content, reason) == ("Checking.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    plain = client.chat.completions.create(**{**ARGS, "max_tokens": 6})
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls


def _bad(param: str, words: str, **body) -> tuple:
    return {**ARGS, **body}, param, words


BAD = [
    _bad("tool_choice", "not in tools", tool_choice={"type": "function",
                                                     "function": {"name": "nope"}}),
    _bad("tool_choice", "or a named function", tool_choice="sometimes"),
    _bad("tool_choice", "or a named function", tool_choice={"type": "function"}),
    _bad("tool_choice", "tool_choice needs tools", tools=None, tool_choice="required"),
    _bad("tools", "tools[1].function.parameters is not a valid JSON schema",
         tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
             "type": "nope"}}}], tool_choice="required"),
    _bad("tools", "tools[0].function.parameters uses an unsupported JSON schema keyword",
         tools=[{"type": "function", "function": {"name": "f", "parameters": {
             "type": "array", "uniqueItems": True}}}], tool_choice={
             "type": "function", "function": {"name": "f"}}),
    _bad("tools", "tools must be an array", tools={"get_weather": {}}),
    _bad("tools", "only function tools", tools=[{"type": "code_interpreter"}]),
    _bad("tools", "tools[1].function.name 'get_weather' is given twice",
         tools=[WEATHER, WEATHER]),
    _bad("tools", "tools[0].function.parameters must be a JSON schema object",
         tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
    _bad("tool_choice", "both constrain the output", tool_choice="required",
         response_format={"type": "json_object"}),
    _bad("messages[1].tool_calls[0].function.arguments", "is not valid JSON",
         messages=[*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [{
             "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": "{oops"}}]}]),
    _bad("tools", "not supported with use_beam_search", use_beam_search=True, n=2),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD,
                         ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tools_are_400_naming_the_field(live_server, body, param, words):
    for stream in (False, True):
        r = live_server.post("/v1/chat/completions", json={**body, "stream": stream})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert live_server.wait_idle()["pjinfer:kv_blocks_used"] == 0
