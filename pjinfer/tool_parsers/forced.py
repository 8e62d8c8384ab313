"""Reading outputs that a grammar forced to be tool calls (`tool_choice` required or named).

`required`: the output is a JSON array of {"name": ..., "parameters": {...}} objects (the
grammar's schema, built by the server, as vLLM's). A named function: the output is that
function's arguments object, nothing else.
"""

from __future__ import annotations

from pjinfer.tool_parsers.base import Parsed, PartialCall, ToolParser, call_of
from pjinfer.tool_parsers.json_scan import scan_object_array, skip_ws


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("")
        items, _ = scan_object_array(text, i, final)
        return Parsed("", tuple(call_of(text, obj) for obj in items))


class NamedToolParser(ToolParser):
    """The whole output is the arguments of `function` (its name is known before any text)."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        arguments = text[skip_ws(text, 0):]
        return Parsed("", (PartialCall(self.function, arguments, final),))
