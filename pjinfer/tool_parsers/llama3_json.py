"""Llama 3.1/3.2/3.3 JSON tool calls: the whole answer is the call.

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>` (kept when special tokens are not skipped), several calls
separated by `;`. An answer that does not start with `{` is plain content; one that starts
with `{` but is no call (no name) turns out to be content once it is complete.
"""

from __future__ import annotations

from pjinfer.tool_parsers.base import Parsed, PartialCall, ToolParser, call_of
from pjinfer.tool_parsers.json_scan import scan_object, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):  # undecided (also: nothing yet)
            return Parsed("")
        if i >= len(text) or text[i] != "{":
            return Parsed(text if final or i < len(text) else "")
        calls: list[PartialCall] = []
        while i < len(text) and text[i] == "{":
            obj = scan_object(text, i, final)
            calls.append(call_of(text, obj))
            if obj.end is None:
                break
            i = skip_ws(text, obj.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        return Parsed("", tuple(calls))
