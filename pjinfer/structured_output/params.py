"""What a request's output must match: vLLM's `StructuredOutputsParams`, checked where it enters.

Exactly one constraint is set. The object is frozen and hashable through `key`: the grammar
compiler caches compiled grammars by it, so 200 requests with one schema compile it once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One of: a JSON schema (dict or JSON text), a regex, a list of choices, a grammar (Lark
    or GBNF), or `json_object=True` (any JSON object). Invalid values raise `ValueError`."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None  # normalised to tuple[str, ...]
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                 f"got {value!r}")
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object must be true, got "
                             f"{self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            return "json", json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind == "choice":
            return "choice", json.dumps(list(value))
        return self.kind, "" if value is True else value


def _schema(schema: Any) -> dict[str, Any]:
    """A JSON schema as a dict (JSON text is parsed here, so a typo fails at once)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError("structured_outputs.json must be a JSON schema object, got "
                         f"{type(schema).__name__}")
    return schema


def _choices(choices: Any) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, list | tuple) or not choices \
            or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("structured_outputs.choice must be a non-empty list of non-empty "
                         f"strings, got {choices!r}")
    return tuple(choices)
