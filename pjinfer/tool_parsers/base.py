"""What every tool-call parser produces, and the two ways of reading it: whole and streamed.

A parser reads a model's output text, complete or not yet, into the plain content before the
calls and the calls themselves, each with its name (once complete) and the raw text of its
arguments so far. One parse function serves both uses: a whole response takes the final
parse (any failure: the text is plain content, as vLLM does), and a stream re-parses the text
so far after each delta and sends what grew since (`ToolCallStream`), so joined fragments
always equal the whole response.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

from pjinfer.tool_parsers.json_scan import NotJSON, ObjectScan, complete_value

ARGUMENT_KEYS = ("arguments", "parameters")  # hermes/mistral say arguments, llama 3 parameters


@dataclass(frozen=True, slots=True)
class PartialCall:
    """One tool call as far as the text goes; `arguments` only ever grows."""

    name: str | None  # None until the name is complete
    arguments: str  # the raw JSON text of the arguments so far
    complete: bool = True


@dataclass(frozen=True, slots=True)
class Parsed:
    """Plain `content` (text before the first call, safe to show now) and the calls."""

    content: str
    calls: tuple[PartialCall, ...] = ()


class ToolParser:
    """Reads one model family's tool-call format. `parse` raises NotJSON when the text has a
    call marker but what follows is no tool call."""

    name: ClassVar[str]
    # False where the call markers are special tokens the detokenizer would drop
    skip_special_tokens: ClassVar[bool] = True

    def parse(self, text: str, final: bool) -> Parsed:
        """`final`: the text is complete (nothing is held back for a marker still arriving)."""
        raise NotImplementedError

    def new_id(self) -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`: they are
    not shown as content until the next delta decides."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def content_before(text: str, marker: str, final: bool) -> Parsed:
    """A text without `marker` (yet): all plain content, but for a marker's possible start."""
    return Parsed(text if final else text[:len(text) - held_back(text, marker)])


def call_of(text: str, obj: ObjectScan) -> PartialCall:
    """The call in a {"name": ..., "arguments" | "parameters": {...}} object scanned so far."""
    name = None
    if "name" in obj.fields and obj.fields["name"][1] is not None:
        name = complete_value(text, *obj.fields["name"])
        if not isinstance(name, str) or not name:
            raise NotJSON(f"a tool call's name must be a non-empty string, got {name!r}")
    key = next((k for k in ARGUMENT_KEYS if k in obj.fields), None)
    if key is None:
        arguments = "{}" if obj.end is not None else ""  # a call without arguments
    else:
        start, end = obj.fields[key]
        if end is not None:
            complete_value(text, start, end)
        arguments = text[start:end] if end is not None else text[start:]
    if obj.end is not None and name is None:
        raise NotJSON("a tool call needs a name")
    return PartialCall(name, arguments, obj.end is not None)


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A finished call in OpenAI's response shape."""

    id: str
    name: str
    arguments: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def extract(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; text that holds no complete, valid call is all
    content (content is None when calls fill the whole text)."""
    try:
        parsed = parser.parse(text, final=True)
    except NotJSON:
        return text, []
    if not parsed.calls or not all(c.complete for c in parsed.calls):
        return text, []
    calls = [ToolCall(parser.new_id(), c.name, c.arguments) for c in parsed.calls
             if c.name is not None]
    return parsed.content or None, calls


class ToolCallStream:
    """One streamed choice: feed it each text delta, get OpenAI delta fields back (content
    and `tool_calls` entries: the first of a call has its index, id, type and name, later
    ones argument fragments); calls past `max_calls` are not sent."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None):
        self.parser, self.max_calls = parser, max_calls
        self.text = ""
        self._content_sent = 0
        self._ids: list[str] = []
        self._args_sent: list[int] = []

    @property
    def called(self) -> bool:
        """Has any call been sent?"""
        return bool(self._ids)

    def feed(self, delta: str, final: bool) -> dict[str, Any]:
        """The delta fields (maybe none) for the text so far plus `delta`."""
        self.text += delta
        try:
            parsed = self.parser.parse(self.text, final)
        except NotJSON:  # no tool call after all: what was held back is content
            parsed = Parsed(self.text if final and not self.called else "")
        fields: dict[str, Any] = {}
        if len(parsed.content) > self._content_sent:
            fields["content"] = parsed.content[self._content_sent:]
            self._content_sent = len(parsed.content)
        calls = [self._call_delta(i, c) for i, c in enumerate(parsed.calls[:self.max_calls])
                 if c.name is not None]
        calls = [c for c in calls if c is not None]
        if calls:
            fields["tool_calls"] = calls
        return fields

    def _call_delta(self, index: int, call: PartialCall) -> dict[str, Any] | None:
        if index == len(self._ids):
            self._ids.append(self.parser.new_id())
            self._args_sent.append(len(call.arguments))
            return {"index": index, "id": self._ids[index], "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}
        if index > len(self._ids):  # an earlier call has no name yet: calls go in order
            return None
        fragment = call.arguments[self._args_sent[index]:]
        if not fragment:
            return None
        self._args_sent[index] = len(call.arguments)
        return {"index": index, "function": {"arguments": fragment}}
