"""Hermes-style tool calls (Hermes 2 Pro, Qwen 2.5/3): JSON objects between tags.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Several calls are several tagged blocks. The content is the text before the first tag; text
after the calls is dropped, as vLLM does. Keys may come in either order (Hermes 2 Pro often
writes `arguments` first).
"""

from __future__ import annotations

from pjinfer.tool_parsers.base import Parsed, PartialCall, ToolParser, call_of, content_before
from pjinfer.tool_parsers.json_scan import NotJSON, scan_object, skip_ws

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    skip_special_tokens = False  # some vocabularies make the tags special tokens

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return content_before(text, START, final)
        calls: list[PartialCall] = []
        tag = first
        while tag >= 0:
            i = skip_ws(text, tag + len(START))
            if i >= len(text):
                break
            if text[i] != "{":
                raise NotJSON(f"{START} must be followed by a JSON object")
            obj = scan_object(text, i, final)
            calls.append(call_of(text, obj))
            if obj.end is None:
                break
            tag = text.find(START, obj.end)
        if final and not calls:
            raise NotJSON(f"{START} with no call after it")
        return Parsed(text[:first], tuple(calls))
