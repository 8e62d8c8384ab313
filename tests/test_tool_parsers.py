"""Tool-call parsers on realistic model outputs: the whole-output reading, and streamed
readings (any split of the text into deltas) that join to exactly the same calls and content."""

from __future__ import annotations

import json
import random

import pytest

from pjinfer.tool_parsers import TOOL_PARSERS, check_tool_options, get_tool_parser
from pjinfer.tool_parsers.base import ToolCallStream, ToolParser, extract
from pjinfer.tool_parsers.choice import ToolChoice
from pjinfer.tool_parsers.forced import NamedToolParser, RequiredToolParser

WEATHER = '{"city": "Paris", "unit": "celsius"}'
NESTED = '{"query": "a \\"quoted\\" {brace} [x]", "filters": {"tags": ["é", "}"], "n": 3}}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    # Qwen 2.5: content first, two tagged blocks
    ("hermes", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
     f'{WEATHER}}}\n</tool_call>\n<tool_call>\n{{"name": "search", "arguments": {NESTED}}}'
     '\n</tool_call>', "Let me check both.\n",
     [("get_weather", WEATHER), ("search", NESTED)]),
    # Hermes 2 Pro: arguments before the name
    ("hermes", '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}\n'
     '</tool_call>', None, [("get_weather", '{"city": "Oslo"}')]),
    ("hermes", '<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    ("hermes", "Paris is sunny; a < b and <tool is not a tag.", "Paris is sunny; a < b and "
     "<tool is not a tag.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    # Llama 3.1: the whole answer is the call
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "search", "parameters": {NESTED}}}; '
     '{"name": "now", "parameters": {}}', None, [("search", NESTED), ("now", "{}")]),
    ("llama3_json", ' {"name": "get_weather", "arguments": {"city": "Rome"}}', None,
     [("get_weather", '{"city": "Rome"}')]),
    ("llama3_json", "It is 21 degrees in Paris.", "It is 21 degrees in Paris.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),  # JSON, but no call
    # Mistral, before tokenizer v11 (a list) and after (name[ARGS]args)
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, '
     f'{{"name": "search", "arguments": {NESTED}}}]', None,
     [("get_weather", WEATHER), ("search", NESTED)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]now[ARGS]{}',
     "Sure.", [("get_weather", '{"city": "Lima"}'), ("now", "{}")]),
    ("mistral", "No tools needed [TOOL", "No tools needed [TOOL", []),
    ("mistral", "[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),  # no [ARGS]
]


def _parser(name: str) -> ToolParser:
    return get_tool_parser(name)()


def _streamed(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    """Feed `text` split at `cuts`; join the deltas as OpenAI's client does."""
    stream = ToolCallStream(parser)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = "", []
    for k, piece in enumerate(pieces):
        delta = stream.feed(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):  # a call's first delta: all its fields
                assert set(call) == {"index", "id", "type", "function"}, call
                assert call["type"] == "function" and call["function"]["name"]
                calls.append({"id": call["id"], **call["function"]})
            else:  # later ones: argument fragments only
                assert set(call) == {"index", "function"} and set(call["function"]) == \
                    {"arguments"}, call
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_whole_and_streamed_outputs_agree(parser, text, content, calls):
    whole_content, whole = extract(_parser(parser), text)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole] == calls
    for c in whole:
        json.loads(c.arguments)
    rng = random.Random(len(text))
    splits = [list(range(1, len(text))), sorted(rng.sample(range(1, len(text)), 5)),
              list(range(3, len(text), 3)), []]
    for cuts in splits:
        streamed_content, streamed = _streamed(_parser(parser), text, cuts)
        if calls:  # content shown before the calls is the whole response's content
            assert streamed_content == (content or "")
        else:  # no call: every character arrives as content, none lost or doubled
            assert streamed_content == text
        got = [(c["name"], c["arguments"]) for c in streamed]
        assert got == (calls if calls else got), cuts
        if calls:
            assert len({c["id"] for c in streamed}) == len(calls)


def test_a_call_cut_off_streams_what_arrived():
    """Whole, an unfinished call is plain content (as vLLM answers); a stream cannot take
    back what it sent: the partial call's fragments went out."""
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert extract(_parser("hermes"), text) == (text, [])
    content, calls = _streamed(_parser("hermes"), text, list(range(1, len(text))))
    assert content == "" and calls[0]["name"] == "get_weather"
    assert calls[0]["arguments"] == '{"city": "Par'


def test_ids():
    (hermes,) = extract(_parser("hermes"), '<tool_call>{"name": "f"}</tool_call>')[1]
    assert hermes.id.startswith("chatcmpl-tool-") and len(hermes.id) > 20
    ids = {_parser("mistral").new_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert hermes.as_json() == {"id": hermes.id, "type": "function",
                                "function": {"name": "f", "arguments": "{}"}}


def test_required_and_named_outputs():
    text = f'[{{"name":"get_weather","parameters":{WEATHER}}},{{"name":"now","parameters":{{}}}}]'
    content, calls = extract(RequiredToolParser(), text)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", WEATHER), ("now", "{}")]
    _, streamed = _streamed(RequiredToolParser(), text, list(range(1, len(text))))
    assert [(c["name"], c["arguments"]) for c in streamed] == [("get_weather", WEATHER),
                                                                ("now", "{}")]
    content, calls = extract(NamedToolParser("get_weather"), WEATHER)
    assert content is None and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", WEATHER)]
    stream = ToolCallStream(NamedToolParser("get_weather"))
    first = stream.feed("", final=False)  # the name goes out before any text
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert stream.feed(WEATHER[:5], False)["tool_calls"][0]["function"] == {
        "arguments": WEATHER[:5]}


def test_tool_choice_message_and_finish_reason():
    auto = ToolChoice("auto", parser_name="hermes")
    message, reason = auto.message('Hi<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                                   "stop")
    assert reason == "tool_calls" and message["content"] == "Hi"
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": "{}"}
    assert auto.message("just text", "stop") == ({"role": "assistant",
                                                  "content": "just text"}, "stop")
    named = ToolChoice("named", function="f")
    assert named.message("{}", "stop")[1] == "stop"  # OpenAI keeps stop for a named function
    required = ToolChoice("required")
    assert required.message('[{"name":"f","parameters":{}}', "length")[1] == "length"
    assert not auto.skip_special_tokens and ToolChoice("auto", parser_name="llama3_json") \
        .skip_special_tokens


def test_registry_and_flags():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes"):
        get_tool_parser("pythonic")
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        check_tool_options(True, None)
    check_tool_options(False, "mistral")
