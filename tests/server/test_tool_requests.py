"""Chat bodies with tools, parsed without an engine: what the chat template gets (tools, an
assistant's tool calls with their arguments as objects, the tool's result), the grammar that
`required` and named choices get, and the refusals that need a server without auto tools."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel
from transformers import AutoTokenizer

from pjinfer.demo import DEMO_MODEL_DIR
from pjinfer.server.protocol import APIError, ModelInfo
from pjinfer.server.tools import parse_tools
from pjinfer.server.validation import parse_chat
from pjinfer.structured_output.grammar import GrammarCompiler

# A Qwen-like template that shows the tools, the calls and the results.
TOOLS_TEMPLATE = """\
{%- if tools %}<|system|>
Functions:{% for tool in tools %}
{{ tool | tojson }}{% endfor %}</s>{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>
{% for call in m.tool_calls %}<tool_call>{{ {'name': call.function.name, \
'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}</s>
{%- elif m.role == 'tool' %}<|user|>
<tool_response id="{{ m.tool_call_id }}">{{ m.content }}</tool_response></s>
{%- else %}<|{{ m.role }}|>
{{ m.content }}</s>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|assistant|>
{% endif %}"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [CALL]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    tokenizer.chat_template = TOOLS_TEMPLATE
    return tokenizer


def _info(tokenizer, tool_parser: str | None = None) -> ModelInfo:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), None)
    return ModelInfo("m", 4096, tokenizer, len(tokenizer),
                     check_structured=compiler.compile, tool_parser=tool_parser)


def _body(**extra) -> dict:
    return {"model": "m", "messages": HISTORY, "tools": [WEATHER], **extra}


def test_the_template_gets_tools_calls_and_results(tokenizer):
    req = parse_chat(_body(tool_choice="none"), _info(tokenizer), "1")
    prompt = tokenizer.decode(req.prompts[0])
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in prompt  # arguments reach the template as an object, not JSON text
    assert '<tool_response id="call_1">21 C</tool_response>' in prompt
    assert req.tools is None and req.params.structured_outputs is None


def test_required_and_named_get_their_grammar(tokenizer):
    req = parse_chat(_body(tool_choice="required"), _info(tokenizer), "1")
    schema = req.params.structured_outputs.json
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "other", "parameters": {"city": "Oslo"}}],
                [{"name": "get_weather", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert "maxItems" not in schema
    one = parse_chat(_body(tool_choice="required", parallel_tool_calls=False),
                     _info(tokenizer), "1")
    assert one.params.structured_outputs.json["maxItems"] == 1 and not one.tools.parallel
    named = parse_chat(_body(tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), _info(tokenizer), "1")
    assert named.params.structured_outputs.json == WEATHER["function"]["parameters"]
    assert (named.tools.mode, named.tools.function) == ("named", "get_weather")


class City(BaseModel):
    name: str


class Trip(BaseModel):
    start: City
    end: City


class Move(BaseModel):
    to: City


def test_required_moves_defs_to_the_root(tokenizer):
    """Pydantic schemas keep shared models in $defs, referenced from the root."""
    tools = [{"type": "function", "function": {"name": n, "parameters": m.model_json_schema()}}
             for n, m in (("trip", Trip), ("move", Move))]
    spec = parse_tools({"tools": tools, "tool_choice": "required"}, _info(tokenizer)).constraint
    jsonschema.validate([{"name": "trip", "parameters": {"start": {"name": "A"}, "end": {
        "name": "B"}}}, {"name": "move", "parameters": {"to": {"name": "C"}}}], spec.json)
    clash = {**Move.model_json_schema(), "$defs": {"City": {"type": "integer"}}}
    tools[1]["function"]["parameters"] = clash
    with pytest.raises(APIError, match=r"tools define \$defs/City twice"):
        parse_tools({"tools": tools, "tool_choice": "required"}, _info(tokenizer))


def test_auto_needs_the_servers_flag(tokenizer):
    for body in (_body(), _body(tool_choice="auto")):  # auto is the default with tools
        with pytest.raises(APIError, match="requires --enable-auto-tool-choice") as error:
            parse_chat(body, _info(tokenizer), "1")
        assert (error.value.status, error.value.param) == (400, "tool_choice")
    req = parse_chat(_body(), _info(tokenizer, "llama3_json"), "1")
    assert (req.tools.mode, req.tools.parser_name) == ("auto", "llama3_json")
    assert req.params.skip_special_tokens and req.params.structured_outputs is None
    mistral = parse_chat(_body(), _info(tokenizer, "mistral"), "1")
    assert not mistral.params.skip_special_tokens  # [TOOL_CALLS] is a special token


def test_required_with_no_tools_is_none(tokenizer):
    req = parse_chat({**_body(tool_choice="required"), "tools": []}, _info(tokenizer), "1")
    assert req.tools is None and req.params.structured_outputs is None
