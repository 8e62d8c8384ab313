"""Structured outputs in a request body: OpenAI's `response_format`, vLLM's `structured_outputs`
object and its older `guided_*` fields, all to one `StructuredOutputsParams`.

The constraint is compiled here, in the parse thread (the engine caches the result), so an
invalid schema, regex or grammar is a 400 naming the field, never a stream that fails later.
"""

from __future__ import annotations

from typing import Any

from pjinfer.server.protocol import APIError, ModelInfo
from pjinfer.structured_output.params import KINDS, StructuredOutputsParams

# body field -> the StructuredOutputsParams field it sets (response_format and
# structured_outputs are objects, parsed below)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
SOURCES = ("response_format", "structured_outputs", *_GUIDED)
_RESPONSE_TYPES = ("text", "json_object", "json_schema")


def parse_structured_outputs(body: dict[str, Any], info: ModelInfo
                             ) -> StructuredOutputsParams | None:
    """The request's output constraint (None: free text), compiled; APIError naming the field
    for a malformed or invalid one, or for two fields that both constrain the output."""
    given = [(name, spec) for name in SOURCES
             if (spec := _from_field(name, body.get(name))) is not None]
    if not given:
        return None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise APIError(f"{' and '.join(names)} both constrain the output; pass only one of "
                       "them", param=names[1])
    name, spec = given[0]
    if info.check_structured is not None:
        try:
            info.check_structured(spec)
        except ValueError as e:
            path = _path(name, spec)
            raise APIError(str(e).replace(f"structured_outputs.{spec.kind}", path, 1),
                           param=name) from None
    return spec


def _from_field(name: str, value: Any) -> StructuredOutputsParams | None:
    if value is None:
        return None
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            if not isinstance(value, dict):
                raise ValueError(f"structured_outputs must be an object with one of "
                                 f"{', '.join(KINDS)}")
            unknown = sorted(set(value) - set(KINDS))
            if unknown:
                raise ValueError(f"structured_outputs.{unknown[0]} is not supported; use one "
                                 f"of {', '.join(KINDS)}")
            return StructuredOutputsParams(**value)
        return StructuredOutputsParams(**{_GUIDED[name]: value})
    except ValueError as e:
        message = str(e)
        if name in _GUIDED:
            message = message.replace(f"structured_outputs.{_GUIDED[name]}", name, 1)
        raise APIError(message, param=name) from None


def _response_format(value: Any) -> StructuredOutputsParams | None:
    """OpenAI's {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in _RESPONSE_TYPES:
        raise ValueError(f"response_format must be an object with type one of "
                         f"{', '.join(_RESPONSE_TYPES)}, got {value!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    json_schema = value.get("json_schema")
    if not isinstance(json_schema, dict) or not isinstance(json_schema.get("schema"), dict):
        raise ValueError("response_format.json_schema must be an object with a schema "
                         "object: {\"name\": ..., \"schema\": {...}}")
    return StructuredOutputsParams(json=json_schema["schema"])


def _path(name: str, spec: StructuredOutputsParams) -> str:
    """Where in the body the constraint came from, for messages."""
    if name == "response_format":
        return "response_format.json_schema.schema"
    if name == "structured_outputs":
        return f"structured_outputs.{spec.kind}"
    return name
