"""A chat request's tool choice, and what it makes of the model's output.

`tool_choice` decides how the output is read: `auto` with the server's `--tool-call-parser`
(the model may answer in text or call tools), `required` as the JSON array of calls the
grammar forced, a named function as that function's arguments. The result is OpenAI's
assistant message (`content`, `tool_calls`) and finish reason, whole or streamed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pjinfer.tool_parsers import get_tool_parser
from pjinfer.tool_parsers.base import ToolCallStream, ToolParser, extract
from pjinfer.tool_parsers.forced import NamedToolParser, RequiredToolParser

MODES = ("auto", "required", "named")


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """How to read one request's output: `mode` is auto, required or named (`function`);
    `parser_name` is the auto mode's parser; without `parallel` (OpenAI's
    `parallel_tool_calls`) only the first call counts."""

    mode: str
    function: str | None = None
    parser_name: str | None = None
    parallel: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if (self.mode == "named") != (self.function is not None):
            raise ValueError("a named tool choice, and only it, names its function")
        if self.mode == "auto":
            get_tool_parser(self.parser_name or "")

    def parser(self) -> ToolParser:
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            return NamedToolParser(self.function)
        return get_tool_parser(self.parser_name)()

    @property
    def skip_special_tokens(self) -> bool:
        """False where the parser reads special tokens (the output must keep them)."""
        return self.mode != "auto" or get_tool_parser(self.parser_name).skip_special_tokens

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """`tool_calls` when the output ended as calls (a named function keeps `stop`, as
        OpenAI's API does); an output cut off by max_tokens keeps `length`."""
        if reason == "stop" and called and self.mode != "named":
            return "tool_calls"
        return reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole assistant message of an output, and its finish reason."""
        content, calls = extract(self.parser(), text)
        calls = calls if self.parallel else calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_json() for c in calls]
        return message, self.finish_reason(reason, bool(calls))

    def stream(self) -> ToolCallStream:
        """A streamed choice's reader (one per choice)."""
        return ToolCallStream(self.parser(), None if self.parallel else 1)
