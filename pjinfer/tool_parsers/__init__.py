"""Tool-call parsers: a model's output text -> OpenAI tool calls, whole or streamed.

`TOOL_PARSERS` maps the `--tool-call-parser` names (vLLM's) to their parsers.
"""

from __future__ import annotations

from pjinfer.tool_parsers.base import ToolParser
from pjinfer.tool_parsers.hermes import HermesToolParser
from pjinfer.tool_parsers.llama3_json import Llama3JsonToolParser
from pjinfer.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class named `name`; ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got "
                         f"{name!r}") from None


def check_tool_options(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """The server's tool flags, as vLLM checks them: auto tool choice needs a parser."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)})")
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)
