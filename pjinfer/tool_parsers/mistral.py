"""Mistral tool calls, after the `[TOOL_CALLS]` special token, in either of its formats:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]    (tokenizer < v11)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                           (v11 and later)

The content is the text before the token. Mistral's chat templates only accept tool call ids
of nine letters and digits, so the ids here have that shape.
"""

from __future__ import annotations

import secrets
import string

from pjinfer.tool_parsers.base import Parsed, PartialCall, ToolParser, call_of, content_before
from pjinfer.tool_parsers.json_scan import (
    WHITESPACE,
    NotJSON,
    complete_value,
    scan_object_array,
    skip_ws,
    value_end,
)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def new_id(self) -> str:
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return content_before(text, TOOL_CALLS, final)
        i = skip_ws(text, first + len(TOOL_CALLS))
        if i < len(text) and text[i] == "[":
            items, _ = scan_object_array(text, i, final)
            calls = tuple(call_of(text, obj) for obj in items)
        else:
            calls = _named_calls(text, first, final)
        if final and not calls:
            raise NotJSON(f"{TOOL_CALLS} with no call after it")
        return Parsed(text[:first], calls)


def _named_calls(text: str, marker: int, final: bool) -> tuple[PartialCall, ...]:
    """`name[ARGS]{...}` calls, each after its own [TOOL_CALLS]."""
    calls: list[PartialCall] = []
    while marker >= 0:
        start = marker + len(TOOL_CALLS)
        args = text.find(ARGS, start)
        if args < 0:
            if final:
                raise NotJSON(f"{TOOL_CALLS} without {ARGS}")
            break  # the name is still arriving
        name = text[start:args].strip()
        if not name or any(c in WHITESPACE for c in name):
            raise NotJSON(f"bad tool name {name!r}")
        i = skip_ws(text, args + len(ARGS))
        end = value_end(text, i, final)
        if end is not None:
            complete_value(text, i, end)
        calls.append(PartialCall(name, text[i:end] if end is not None else text[i:],
                                 end is not None))
        if end is None:
            break
        marker = text.find(TOOL_CALLS, end)
    return tuple(calls)
