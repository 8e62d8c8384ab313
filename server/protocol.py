"""The OpenAI wire format: request bodies -> validated engine inputs, engine outputs -> JSON.

Everything a client can get wrong is checked here, before the engine sees it, and raised as an
`APIError` that names the parameter; handlers stay free of format details. Bodies are plain
dicts (no schema library): the checks are few and each message says how to fix the request.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from pjinfer.errors import EngineDeadError, EngineOverloadedError
from pjinfer.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pjinfer.sampling_params import MAX_N, SamplingParams
from pjinfer.tokenizer import apply_chat_template

MAX_PROMPTS = 1024  # prompts in one batched completions request
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# body key -> SamplingParams field, shared by both endpoints (OpenAI names, then vLLM's extras)
_SAMPLING_FIELDS = {
    "temperature": "number", "top_p": "number", "n": "int", "stop": "any", "seed": "int",
    "presence_penalty": "number", "frequency_penalty": "number", "top_k": "int",
    "min_p": "number", "repetition_penalty": "number", "min_tokens": "int",
    "ignore_eos": "bool", "stop_token_ids": "list", "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool", "prompt_logprobs": "int",
}
_KINDS = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
          "list": "an array", "dict": "an object"}


class APIError(Exception):
    """An error the client sees as OpenAI's `{"error": {...}}` body with `status`."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = (
            message, status, param, type, code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def error_for(exc: BaseException) -> APIError:
    """The API error a client sees for an exception from validation or the engine."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineOverloadedError):
        return APIError(str(exc), status=503, type="server_overloaded", code="overloaded")
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status=503, type="server_error", code="engine_dead")
    if isinstance(exc, ValueError):
        return APIError(str(exc), param=_param_of(str(exc)))
    return APIError(f"internal error: {type(exc).__name__}: {exc}", status=500,
                    type="server_error")


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What request validation needs to know about the served model."""

    served_model_name: str
    max_model_len: int
    tokenizer: Any


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completions or chat request: token-id prompts plus shared sampling params."""

    id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    echo_texts: tuple[str, ...] | None = None  # completions `echo`: one text per prompt
    priority: int = 0


# ---- parsing ------------------------------------------------------------------------------
def get_field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against `kind`; null means the default, as in OpenAI's API."""
    value = body.get(name)
    if value is None:
        return default
    ok = {
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool)
        and math.isfinite(v),
        "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
        "list": lambda v: isinstance(v, list), "dict": lambda v: isinstance(v, dict),
        "any": lambda v: True,
    }[kind](value)
    if not ok:
        raise APIError(f"{name} must be {_KINDS[kind]}"
                       f"{' (finite)' if kind == 'number' else ''}, got {value!r}", param=name)
    return value


def check_model(body: dict[str, Any], info: ModelInfo, *, required: bool = True) -> str:
    """The `model` field must name the served model (404 otherwise, as OpenAI does)."""
    model = get_field(body, "model", "str")
    if model is None:
        if required:
            raise APIError("model is required: pass the served model name "
                           f"{info.served_model_name!r}", param="model")
        return info.served_model_name
    if model != info.served_model_name:
        raise APIError(f"The model `{model}` does not exist; this server serves "
                       f"{info.served_model_name!r}", status=404, param="model",
                       code="model_not_found")
    return model


def parse_completion(body: dict[str, Any], info: ModelInfo) -> GenerationRequest:
    model = check_model(body, info)
    texts, prompts = _completion_prompts(body.get("prompt"), info.tokenizer)
    logprobs = get_field(body, "logprobs", "int")
    echo = get_field(body, "echo", "bool", False)
    max_tokens = get_field(body, "max_tokens", "int", 16)
    params = _sampling_params(body, max_tokens, logprobs)
    if echo and logprobs is not None:  # echoed prompt tokens carry logprobs too
        params = _with(params, prompt_logprobs=max(logprobs, params.prompt_logprobs or 0))
    _check_lengths(prompts, params, info, "prompt")
    return _request("cmpl", model, prompts, params, body,
                    echo_texts=tuple(texts) if echo else None)


def parse_chat(body: dict[str, Any], info: ModelInfo) -> GenerationRequest:
    model = check_model(body, info)
    messages = parse_messages(body.get("messages"))
    add_generation_prompt = get_field(body, "add_generation_prompt", "bool", True)
    try:
        prompt = apply_chat_template(info.tokenizer, messages,
                                     add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(str(e), param="messages") from None
    max_tokens = get_field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", "int")
    params = _sampling_params(body, max_tokens, _chat_logprobs(body))
    _check_lengths([prompt], params, info, "messages")
    return _request("chatcmpl", model, [prompt], params, body)


def parse_messages(messages: Any) -> list[dict[str, str]]:
    """Chat messages with string content; text parts are joined, other parts rejected."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty array of {role, content} objects",
                       param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"{param} must be an object with role and content", param=param)
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise APIError(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                       param=f"{param}.role")
    if isinstance(content, list):
        content = "".join(_text_part(p, f"{param}.content[{j}]") for j, p in enumerate(content))
    if not isinstance(content, str):
        raise APIError(f"{param}.content must be a string or an array of text parts, got "
                       f"{content!r}", param=f"{param}.content")
    return {"role": role, "content": content}


def _text_part(part: Any, param: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text" \
            or not isinstance(part.get("text"), str):
        raise APIError(f"{param} must be {{\"type\": \"text\", \"text\": \"...\"}}; only text "
                       "content is supported", param=param)
    return part["text"]


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = get_field(body, "logprobs", "bool", False)
    top = get_field(body, "top_logprobs", "int")
    if top is not None and not wanted:
        raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
    return (top or 0) if wanted else None


def _completion_prompts(prompt: Any, tokenizer: Any) -> tuple[list[str], list[list[int]]]:
    """(texts for echo, token ids) of a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or _is_token_list(p) for p in prompt):
        raise APIError("prompt must be a string, an array of strings, an array of token ids "
                       "or an array of token-id arrays (none empty)", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                       param="prompt")
    if any(p == "" or p == [] for p in prompt):
        raise APIError("prompt must not be empty", param="prompt")
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompt]
    return texts, ids


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _sampling_params(body: dict[str, Any], max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    kwargs = {name: get_field(body, name, kind) for name, kind in _SAMPLING_FIELDS.items()}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    n = kwargs.get("n", 1)
    if isinstance(n, int) and n > MAX_N:
        raise APIError(f"n must be at most {MAX_N}, got {n}", param="n")
    kwargs["logit_bias"] = _logit_bias(get_field(body, "logit_bias", "dict"))
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    except ValueError as e:
        raise APIError(str(e), param=_param_of(str(e))) from None


def _logit_bias(bias: dict[str, Any] | None) -> dict[int, float] | None:
    """JSON object keys are strings; OpenAI's logit_bias maps token-id strings to [-100, 100]."""
    if bias is None:
        return None
    try:
        parsed = {int(k): v for k, v in bias.items()}
    except ValueError:
        raise APIError(f"logit_bias keys must be token ids, got {list(bias)}",
                       param="logit_bias") from None
    for value in parsed.values():
        if isinstance(value, int | float) and not isinstance(value, bool) \
                and not -100 <= value <= 100:
            raise APIError(f"logit_bias values must be in [-100, 100], got {value}",
                           param="logit_bias")
    return parsed


def _param_of(message: str) -> str | None:
    """SamplingParams messages start with the field name: point `param` at it."""
    head = message.split(" ", 1)[0].split("/", 1)[0]
    known = set(_SAMPLING_FIELDS) | {"max_tokens", "logprobs", "logit_bias"}
    return head if head in known else None


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    try:
        return replace(params, **changes)
    except ValueError as e:
        raise APIError(str(e), param=_param_of(str(e))) from None


def _check_lengths(prompts: list[list[int]], params: SamplingParams, info: ModelInfo,
                   what: str) -> None:
    """vLLM's messages: the prompt must leave room, and prompt + max_tokens must fit."""
    limit = info.max_model_len
    for ids in prompts:
        if len(ids) >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                           f"your request has {len(ids)} input tokens. Please reduce the length "
                           f"of the input {what}.", param=what)
        if params.max_tokens is not None and len(ids) + params.max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, "
                           f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in "
                           f"the {what}, {params.max_tokens} in the completion). Please reduce "
                           f"the length of the {what} or completion.", param="max_tokens")


def _request(kind: str, model: str, prompts: list[list[int]], params: SamplingParams,
             body: dict[str, Any], **extra: Any) -> GenerationRequest:
    stream = get_field(body, "stream", "bool", False)
    options = get_field(body, "stream_options", "dict", {})
    include_usage = get_field(options, "include_usage", "bool", False)
    get_field(body, "user", "str")
    priority = get_field(body, "priority", "int", 0)
    return GenerationRequest(id=f"{kind}-{uuid.uuid4().hex}", created=int(time.time()),
                             model=model, prompts=prompts, params=params, stream=stream,
                             include_usage=include_usage and stream, priority=priority, **extra)


# ---- responses ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Summary:
    """A finished request as usage and metrics see it (summed over a stream's deltas)."""

    prompt_token_ids: list[int]
    metrics: RequestMetrics | None
    num_tokens: list[int]  # per choice
    finish_reasons: list[str | None]  # per choice

    @classmethod
    def of(cls, out: RequestOutput) -> Summary:
        """From a whole (cumulative or final-only) output."""
        return cls(out.prompt_token_ids, out.metrics, [len(c.token_ids) for c in out.outputs],
                   [c.finish_reason for c in out.outputs])


def usage(finished: list[Summary]) -> dict[str, int]:
    prompt = sum(len(s.prompt_token_ids) for s in finished)
    completion = sum(sum(s.num_tokens) for s in finished)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_response(req: GenerationRequest, outputs: list[RequestOutput],
                        tokenizer: Any) -> dict[str, Any]:
    choices = []
    for p, out in enumerate(outputs):
        for c in out.outputs:
            prefix = req.echo_texts[p] if req.echo_texts else ""
            choices.append({
                "index": p * req.params.n + c.index, "text": prefix + c.text,
                "logprobs": completion_logprobs(req, out, c, tokenizer),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
    return {"id": req.id, "object": "text_completion", "created": req.created,
            "model": req.model, "choices": choices,
            "usage": usage([Summary.of(o) for o in outputs])}


def chat_response(req: GenerationRequest, out: RequestOutput, tokenizer: Any) -> dict[str, Any]:
    choices = [{
        "index": c.index, "message": {"role": "assistant", "content": c.text},
        "logprobs": chat_logprobs(c.logprobs, tokenizer, req.params.logprobs),
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    } for c in out.outputs]
    return {"id": req.id, "object": "chat.completion", "created": req.created,
            "model": req.model, "choices": choices, "usage": usage([Summary.of(out)])}


def completion_logprobs(req: GenerationRequest, out: RequestOutput, c: CompletionOutput,
                        tokenizer: Any, start: int = 0, text_offset: int = 0,
                        with_prompt: bool = True) -> dict[str, Any] | None:
    """OpenAI's legacy {tokens, token_logprobs, top_logprobs, text_offset}, from position
    `start` of the completion; an echoed prompt's positions come first."""
    if req.params.logprobs is None:
        return None
    positions: list[tuple[int, PositionLogprobs | None]] = []
    if req.echo_texts and with_prompt:
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        positions += list(zip(out.prompt_token_ids, prompt_lps, strict=False))
    positions += [(tid, lp) for tid, lp in zip(c.token_ids[start:], (c.logprobs or [])[start:],
                                               strict=False)]
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
    for tid, entry in positions:
        token = _token_text(tokenizer, tid, entry.get(tid) if entry else None)
        result["tokens"].append(token)
        result["token_logprobs"].append(entry[tid].logprob if entry else None)
        result["top_logprobs"].append({_token_text(tokenizer, t, lp): lp.logprob
                                       for t, lp in _top(entry, req.params.logprobs)}
                                      if entry else None)
        result["text_offset"].append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(logprobs: list[PositionLogprobs] | None, tokenizer: Any,
                  top_n: int | None) -> dict[str, Any] | None:
    """OpenAI's chat format: {content: [{token, logprob, bytes, top_logprobs}]}."""
    if top_n is None or logprobs is None:
        return None
    content = []
    for entry in logprobs:
        tid, chosen = next(iter(entry.items()))  # the engine puts the chosen token first
        content.append({**_chat_token(tokenizer, tid, chosen), "top_logprobs": [
            _chat_token(tokenizer, t, lp) for t, lp in _top(entry, top_n)]})
    return {"content": content}


def _chat_token(tokenizer: Any, tid: int, lp: Logprob) -> dict[str, Any]:
    token = _token_text(tokenizer, tid, lp)
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}


def _top(entry: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The n most likely tokens by rank (the chosen token only if it is among them)."""
    return sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n),
                  key=lambda item: item[1].rank)[:n]


def _token_text(tokenizer: Any, tid: int, lp: Logprob | None) -> str:
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([tid])
