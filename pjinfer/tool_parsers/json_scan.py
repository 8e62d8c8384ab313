"""Scanning JSON that may still be arriving: where values start and end, never re-serialised.

A streamed tool call is a JSON object whose text grows token by token. The parsers need to
know, at any prefix, which keys are complete and where the `arguments` value starts, so that
they can send its raw text as it grows: a raw slice of the model's output only ever gets
longer, so the fragments sent join to exactly the final arguments. A full parse
(`json.loads`) checks each value once it is complete.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

WHITESPACE = " \t\r\n"
_LITERAL = frozenset("0123456789+-.eEtruefalsn")  # numbers, true, false, null


class NotJSON(ValueError):
    """The text is not (the start of) the JSON the parser expects."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """Index just past the JSON value that starts at `text[i]`, or None if the text ends
    inside it (`final`: the text is complete, so a number at its very end is whole). Only
    the extent is found here; `complete_value` checks the contents."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        return _nested_end(text, i)
    if c not in _LITERAL:
        raise NotJSON(f"unexpected {c!r} at offset {i}")
    j = i
    while j < len(text) and text[j] in _LITERAL:
        j += 1
    return j if j < len(text) or final else None


def _string_end(text: str, i: int) -> int | None:
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return j + 1
        j += 1
    return None


def _nested_end(text: str, i: int) -> int | None:
    """Past the bracket that closes `text[i]` (strings skipped), or None."""
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def complete_value(text: str, start: int, end: int) -> object:
    """The parsed value of a complete slice; NotJSON if it is not valid JSON."""
    try:
        return json.loads(text[start:end])
    except json.JSONDecodeError as e:
        raise NotJSON(str(e)) from None


@dataclass(slots=True)
class ObjectScan:
    """A JSON object's top-level keys as far as the text goes: key -> (value start, value
    end or None while the value is still arriving); `end` is past its `}` once it closed."""

    start: int
    fields: dict[str, tuple[int, int | None]] = field(default_factory=dict)
    end: int | None = None


def scan_object(text: str, i: int, final: bool) -> ObjectScan:
    """Scan the object starting at `text[i] == "{"` as far as the text goes; NotJSON when
    what is there cannot be the start of an object."""
    if text[i] != "{":
        raise NotJSON(f"expected an object at offset {i}, got {text[i]!r}")
    scan = ObjectScan(i)
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        scan.end = j + 1
        return scan
    while j < len(text):
        if text[j] != '"':
            raise NotJSON(f"expected a key at offset {j}, got {text[j]!r}")
        key_end = _string_end(text, j)
        if key_end is None:
            return scan
        key = complete_value(text, j, key_end)
        j = skip_ws(text, key_end)
        if j >= len(text):
            return scan
        if text[j] != ":":
            raise NotJSON(f"expected ':' after key {key!r} at offset {j}")
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return scan
        end = value_end(text, j, final)
        scan.fields[str(key)] = (j, end)
        if end is None:
            return scan
        j = skip_ws(text, end)
        if j >= len(text):
            return scan
        if text[j] == "}":
            scan.end = j + 1
            return scan
        if text[j] != ",":
            raise NotJSON(f"expected ',' or '}}' at offset {j}, got {text[j]!r}")
        j = skip_ws(text, j + 1)
    return scan


def scan_object_array(text: str, i: int, final: bool) -> tuple[list[ObjectScan], int | None]:
    """The objects of the array at `text[i] == "["` as far as the text goes (the last may be
    open) and the offset past its `]` (None while the array is open)."""
    if text[i] != "[":
        raise NotJSON(f"expected an array at offset {i}, got {text[i]!r}")
    items: list[ObjectScan] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "]":
        return items, j + 1
    while j < len(text):
        items.append(scan_object(text, j, final))
        if items[-1].end is None:
            return items, None
        j = skip_ws(text, items[-1].end)
        if j >= len(text):
            return items, None
        if text[j] == "]":
            return items, j + 1
        if text[j] != ",":
            raise NotJSON(f"expected ',' or ']' at offset {j}, got {text[j]!r}")
        j = skip_ws(text, j + 1)
    return items, None
