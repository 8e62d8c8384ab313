"""Tools in a chat request body: `tools`, `tool_choice`, and tool calls in the messages.

The tools go to the chat template (HF templates' `tools` argument), as vLLM passes them.
`tool_choice` `required` and a named function are enforced with a JSON-schema grammar
through the structured-output path (vLLM's schema for `required`: an array of
{"name", "parameters"} objects, anyOf over the tools); `auto` needs the server's
`--enable-auto-tool-choice --tool-call-parser NAME`. Everything is checked here, in the parse
thread: a bad tool, an unknown function or an invalid parameters schema is a 400 naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pjinfer.server.protocol import APIError, ModelInfo
from pjinfer.structured_output.params import StructuredOutputsParams
from pjinfer.tool_parsers.choice import ToolChoice

CHOICES = ("none", "auto", "required")
NAMED_USAGE = 'use {"type": "function", "function": {"name": "my_function"}}'
MAX_NAME_CHARS = 64
_DEFS_KEYS = ("$defs", "definitions")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ChatTools:
    """A request's checked tools: what the template gets, how to read the output (None:
    as text), and the grammar that forces the calls (None: nothing forced)."""

    template_tools: list[dict[str, Any]] | None
    choice: ToolChoice | None
    constraint: StructuredOutputsParams | None



def parse_tools(body: dict[str, Any], info: ModelInfo) -> ChatTools:
    """`tools` and `tool_choice` of a chat body (APIError naming the field when wrong)."""
    tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    if choice != "none" and tools is None:
        raise APIError("tool_choice needs tools: pass the functions the model may call in "
                       "tools, or leave tool_choice out", param="tool_choice")
    if not tools or choice == "none":  # OpenAI: required with no tools means none
        return ChatTools(tools or None, None, None)
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool | None):
        raise APIError(f"parallel_tool_calls must be a boolean, got {parallel!r}",
                       param="parallel_tool_calls")
    parallel = parallel is not False
    if choice == "auto":
        if info.tool_parser is None:
            raise APIError('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set on the server; or pass tool_choice "
                           '"required", "none" or a named function', param="tool_choice")
        return ChatTools(tools, ToolChoice("auto", parser_name=info.tool_parser,
                                           parallel=parallel), None)
    if choice == "required":
        schemas = [_checked_parameters(tool, i, info) for i, tool in enumerate(tools)]
        spec = _compiled(_required_schema(tools, schemas, parallel), info, "tools")
        return ChatTools(tools, ToolChoice("required", parallel=parallel), spec)
    name = _named(choice)
    index = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), None)
    if index is None:
        known = ", ".join(t["function"]["name"] for t in tools)
        raise APIError(f"tool_choice names the function {name!r}, which is not in tools "
                       f"(they are: {known})", param="tool_choice")
    spec = _compiled(_parameters(tools[index]), info, f"tools[{index}].function.parameters")
    return ChatTools(tools, ToolChoice("named", function=name), spec)


def template_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The body's tools as the chat template gets them (checked; None when none)."""
    return _tools(body.get("tools")) or None


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """The function tools, checked; None when absent."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise APIError('tools must be an array of {"type": "function", "function": {"name": '
                       '..., "parameters": {...}}} objects', param="tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = _tool(tool, f"tools[{i}]")
        if name in seen:
            raise APIError(f"tools[{i}].function.name {name!r} is given twice; function names "
                           "must be unique", param="tools")
        seen.add(name)
    return tools


def _tool(tool: Any, where: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise APIError(f'{where} must be {{"type": "function", "function": {{...}}}}; only '
                       "function tools are supported", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise APIError(f"{where}.function must be an object with name, description and "
                       "parameters", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS \
            or any(c.isspace() for c in name):
        raise APIError(f"{where}.function.name must be a string of 1 to {MAX_NAME_CHARS} "
                       f"characters without spaces, got {name!r}", param="tools")
    for key, kind, what in (("description", str, "a string"), ("parameters", dict,
                            "a JSON schema object"), ("strict", bool, "a boolean")):
        if function.get(key) is not None and not isinstance(function[key], kind):
            raise APIError(f"{where}.function.{key} must be {what}, got {function[key]!r}",
                           param="tools")
    return name


def _named(choice: Any) -> str:
    if isinstance(choice, str):
        raise APIError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function "
                       f"({NAMED_USAGE}), got {choice!r}", param="tool_choice")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" \
            or not isinstance(name, str) or not name:
        raise APIError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function "
                       f"({NAMED_USAGE}), got {choice!r}", param="tool_choice")
    return name


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters schema; a function without one takes an empty object."""
    return tool["function"].get("parameters") or _EMPTY_PARAMETERS


def _checked_parameters(tool: dict[str, Any], i: int, info: ModelInfo) -> dict[str, Any]:
    """One tool's parameters, compiled alone so that an invalid one is named by index."""
    schema = _parameters(tool)
    _compiled(schema, info, f"tools[{i}].function.parameters")
    return schema


def _required_schema(tools: list[dict[str, Any]], schemas: list[dict[str, Any]],
                     parallel: bool = True) -> dict[str, Any]:
    """A non-empty array of calls (one, without `parallel`), each {"name": one tool's name,
    "parameters": its arguments}. `$defs` move to the root, where the tools'
    `#/$defs/...` refs point."""
    defs: dict[str, Any] = {}
    variants = []
    for tool, schema in zip(tools, schemas, strict=True):
        for key in _DEFS_KEYS:
            for name, definition in schema.get(key, {}).items():
                if defs.setdefault(name, definition) != definition:
                    raise APIError(f"tools define {key}/{name} twice, differently; "
                                   "rename one of them", param="tools")
        parameters = {k: v for k, v in schema.items() if k not in _DEFS_KEYS}
        variants.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": parameters}, "required": ["name", "parameters"],
            "additionalProperties": False})
    root: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants},
                            **({} if parallel else {"maxItems": 1})}
    if defs:
        root["$defs"] = defs  # "definitions" refs keep working: both are copied there too
        root["definitions"] = defs
    return root


def _compiled(schema: dict[str, Any], info: ModelInfo, path: str) -> StructuredOutputsParams:
    """The schema as a constraint, compiled (cached by the engine); 400 naming `path`."""
    try:
        spec = StructuredOutputsParams(json=schema)
        if info.check_structured is not None:
            info.check_structured(spec)
    except ValueError as e:
        raise APIError(str(e).replace("structured_outputs.json", path, 1),
                       param="tools") from None
    return spec


# ---- messages ------------------------------------------------------------------------------
def message_tool_fields(message: dict[str, Any], param: str) -> dict[str, Any]:
    """The tool fields of a chat message, for the template: an assistant's `tool_calls`
    (arguments parsed to objects, as HF templates expect and vLLM passes them) and a tool
    result's `tool_call_id`."""
    fields: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant" or not isinstance(calls, list):
            raise APIError(f"{param}.tool_calls must be an array, on an assistant message",
                           param=f"{param}.tool_calls")
        fields["tool_calls"] = [_call(c, f"{param}.tool_calls[{j}]")
                                for j, c in enumerate(calls)]
    call_id = message.get("tool_call_id")
    if call_id is not None:
        if not isinstance(call_id, str):
            raise APIError(f"{param}.tool_call_id must be a string, got {call_id!r}",
                           param=f"{param}.tool_call_id")
        fields["tool_call_id"] = call_id
    if message.get("role") == "tool" and isinstance(message.get("name"), str):
        fields["name"] = message["name"]
    return fields


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(f'{where} must be {{"id": ..., "type": "function", "function": '
                       '{"name": ..., "arguments": "<JSON text>"}}', param=where)
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise APIError(f"{where}.function.arguments is not valid JSON: {e}",
                           param=f"{where}.function.arguments") from None
    result = {"type": "function", "function": {"name": function["name"],
                                               "arguments": arguments}}
    if isinstance(call.get("id"), str):
        result["id"] = call["id"]
    return result
