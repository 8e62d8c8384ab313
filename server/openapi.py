"""The OpenAPI 3 description of the server, served at /openapi.json.

Written by hand, not generated: handlers take plain JSON bodies (server.validation checks
them), so there are no models to derive a schema from. Client generators and API fuzzers
(tests/server/test_fuzz.py drives schemathesis with it) read it; the bounds here are the ones
validation enforces, so a request that follows the schema never gets a 4xx for a range.
"""

from __future__ import annotations

from typing import Any

import pjinfer
from pjinfer.sampling_params import MAX_N
from pjinfer.server.validation import CHAT_ROLES

_ERROR = {"description": "OpenAI error body",
          "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}


def _number(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi, "nullable": True}


def _integer(lo: int, hi: int | None = None) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "nullable": True,
            **({} if hi is None else {"maximum": hi})}


def _sampling(max_model_len: int) -> dict[str, Any]:
    """Fields both generation endpoints take (OpenAI's, then vLLM's extras)."""
    stop = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"},
                                           "maxItems": 4}], "nullable": True}
    return {
        "model": {"type": "string"}, "max_tokens": _integer(1, max_model_len - 1),
        "temperature": _number(0, 2), "top_p": _number(0.01, 1), "n": _integer(1, MAX_N),
        "stream": {"type": "boolean", "nullable": True}, "stop": stop,
        "stream_options": {"type": "object", "nullable": True,
                           "properties": {"include_usage": {"type": "boolean"},
                                          "continuous_usage_stats": {"type": "boolean"}}},
        "seed": _integer(0, 2**31), "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2), "user": {"type": "string", "nullable": True},
        "top_k": _integer(0, 100), "min_p": _number(0, 1),
        "repetition_penalty": _number(0.5, 2), "ignore_eos": {"type": "boolean"},
        "priority": _integer(-100, 100),
    }


def _generation_request(fields: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": fields}


def _post(summary: str, schema_ref: str, answer: str) -> dict[str, Any]:
    body = {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{schema_ref}"}}}}
    return {"post": {"summary": summary, "requestBody": body, "responses": {
        "200": {"description": answer, "content": {**_JSON_OBJECT, "text/event-stream": {}}},
        "default": _ERROR}}}


def _get(summary: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
    ok = {"description": summary, **({"content": content} if content else {})}
    return {"get": {"summary": summary, "responses": {"200": ok, "default": _ERROR}}}


def openapi_schema(model: str, max_model_len: int, vocab_size: int,
                   max_logprobs: int) -> dict[str, Any]:
    """The schema for one served model (its name and length bounds appear in it)."""
    sampling = _sampling(max_model_len)
    sampling["model"] = {"type": "string", "enum": [model]}
    prompt = {"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
         "maxItems": 4},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1},
         "minItems": 1, "maxItems": 32}]}
    completion = _generation_request({
        **sampling, "prompt": prompt, "echo": {"type": "boolean", "nullable": True},
        "logprobs": _integer(0, max_logprobs)}, ["model", "prompt"])
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"type": "string", "enum": list(CHAT_ROLES[:4])},
        "content": {"type": "string"}}}
    chat = _generation_request({
        **sampling, "messages": {"type": "array", "items": message, "minItems": 1,
                                 "maxItems": 4},
        "max_completion_tokens": _integer(1, max_model_len - 1),
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": _integer(0, max_logprobs)}, ["model", "messages"])
    tokenize = {"type": "object", "properties": {"model": sampling["model"],
                                                 "prompt": {"type": "string"},
                                                 "add_special_tokens": {"type": "boolean"}}}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": sampling["model"],
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                               "maximum": vocab_size - 1}}}}
    load_lora = {"type": "object", "required": ["lora_name", "lora_path"], "properties": {
        "lora_name": {"type": "string"}, "lora_path": {"type": "string"}}}
    unload_lora = {"type": "object", "required": ["lora_name"],
                   "properties": {"lora_name": {"type": "string"}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "properties": {k: {"type": "string", "nullable": True}
                                         for k in ("message", "type", "param", "code")}}}}
    model_path = {"name": "model_id", "in": "path", "required": True,
                  "schema": {"type": "string"}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "pjinfer OpenAI-compatible API", "version": pjinfer.__version__},
        "components": {
            "schemas": {"CompletionRequest": completion, "ChatCompletionRequest": chat,
                        "TokenizeRequest": tokenize, "DetokenizeRequest": detokenize,
                        "LoadLoRAAdapterRequest": load_lora,
                        "UnloadLoRAAdapterRequest": unload_lora,
                        "Error": error},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": {
            "/v1/models": _get("the served model", _JSON_OBJECT),
            "/v1/models/{model_id}": {"get": {**_get("one model card")["get"],
                                              "parameters": [model_path]}},
            "/v1/completions": _post("text completion", "CompletionRequest",
                                     "text_completion (or its SSE chunks with stream)"),
            "/v1/chat/completions": _post("chat completion", "ChatCompletionRequest",
                                          "chat.completion (or its SSE chunks with stream)"),
            "/v1/load_lora_adapter": _post(
                "serve a PEFT LoRA folder under a name (--allow-runtime-lora-updating)",
                "LoadLoRAAdapterRequest", "a success message"),
            "/v1/unload_lora_adapter": _post(
                "stop serving a LoRA adapter (--allow-runtime-lora-updating)",
                "UnloadLoRAAdapterRequest", "a success message"),
            "/tokenize": _post("token ids of a prompt", "TokenizeRequest", "token ids"),
            "/detokenize": _post("text of token ids", "DetokenizeRequest", "the text"),
            "/health": _get("200 while the engine serves, 503 once it is dead or stuck"),
            "/version": _get("the pjinfer version", _JSON_OBJECT),
            "/metrics": _get("Prometheus metrics", {"text/plain": {}}),
            "/openapi.json": _get("this document", _JSON_OBJECT),
        },
        "security": [{"bearer": []}],
    }
