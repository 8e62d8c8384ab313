"""Request bodies -> validated engine inputs, in the OpenAI wire format.

Everything a client can get wrong is checked here, before the engine sees it, and raised as an
`APIError` that names the parameter; handlers stay free of format details. Bodies are plain
dicts (no schema library): the checks are few and each message says how to fix the request.
These functions tokenize, so the app runs them off the event loop.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

from pjinfer.sampling_params import MAX_N, SamplingParams
from pjinfer.server.protocol import APIError, GenerationRequest, ModelInfo, param_of
from pjinfer.server.structured_outputs import SOURCES as STRUCTURED_FIELDS
from pjinfer.server.structured_outputs import parse_structured_outputs
from pjinfer.server.tools import message_tool_fields, parse_tools, template_tools
from pjinfer.tokenizer import apply_chat_template

MAX_PROMPTS = 1024  # prompts in one batched completions request
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields this server does not implement (OpenAI's, vLLM's): refused rather than silently
# ignored, each with what to do instead
UNSUPPORTED = {
    "suffix": "leave it out or null",
}

# body key -> SamplingParams field, shared by both endpoints (OpenAI names, then vLLM's extras)
_SAMPLING_FIELDS = {
    "temperature": "number", "top_p": "number", "n": "int", "stop": "any", "seed": "int",
    "presence_penalty": "number", "frequency_penalty": "number", "top_k": "int",
    "min_p": "number", "repetition_penalty": "number", "min_tokens": "int",
    "ignore_eos": "bool", "stop_token_ids": "list", "skip_special_tokens": "bool",
    "include_stop_str_in_output": "bool", "prompt_logprobs": "int",
    "allowed_token_ids": "list", "truncate_prompt_tokens": "int", "bad_words": "list",
}
# every body field each endpoint reads (or refuses by name); the rest are logged as ignored,
# as vLLM does
_COMMON_FIELDS = ("model", "max_tokens", "logprobs", "logit_bias", "best_of", "stream",
                  "stream_options", "user", "priority", "use_beam_search", "length_penalty",
                  "return_tokens_as_token_ids")
_SHARED_FIELDS = (*_COMMON_FIELDS, *_SAMPLING_FIELDS, *STRUCTURED_FIELDS, *UNSUPPORTED)
COMPLETION_FIELDS = frozenset((*_SHARED_FIELDS, "prompt", "echo", "add_special_tokens"))
CHAT_FIELDS = frozenset((*_SHARED_FIELDS, "messages", "max_completion_tokens", "top_logprobs",
                         "tools", "tool_choice", "parallel_tool_calls", "add_generation_prompt",
                         "continue_final_message", "chat_template_kwargs", "chat_template"))
log = logging.getLogger("pjinfer.server")
_KINDS = {"int": "an integer", "number": "a number", "bool": "a boolean", "str": "a string",
          "list": "an array", "dict": "an object"}
_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool)
    and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool), "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, list), "dict": lambda v: isinstance(v, dict),
    "any": lambda v: True,
}


def get_field(body: dict[str, Any], name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked against `kind`; null means the default, as in OpenAI's API."""
    value = body.get(name)
    if value is None:
        return default
    if not _CHECKS[kind](value):
        raise APIError(f"{name} must be {_KINDS[kind]}"
                       f"{' (finite)' if kind == 'number' else ''}, got {value!r}", param=name)
    return check_text(value, name) if kind == "str" else value


def check_text(text: str, param: str) -> str:
    """JSON may escape a lone surrogate ("\\ud800"), which is no Unicode text: the tokenizer
    (and the UTF-8 response) cannot take it, so it is the client's error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"{param} is not valid Unicode: it has a lone surrogate "
                       f"{text[e.start]!r} at index {e.start}", param=param) from None
    return text


def check_model(body: dict[str, Any], info: ModelInfo, *, required: bool = True) -> str:
    """The `model` field must name the served model or one of its LoRA adapters (404
    otherwise, as OpenAI does)."""
    model = get_field(body, "model", "str")
    if model is None:
        if required:
            raise APIError("model is required: pass the served model name "
                           f"{info.served_model_name!r}", param="model")
        return info.served_model_name
    if model != info.served_model_name and model not in info.lora_names():
        raise model_not_found(model, info)
    return model


def model_not_found(model: str, info: ModelInfo) -> APIError:
    adapters = "".join(f", {name!r}" for name in sorted(info.lora_names()))
    return APIError(f"The model `{model}` does not exist; this server serves "
                    f"{info.served_model_name!r}{adapters}", status=404, param="model",
                    code="model_not_found")


def parse_completion(body: dict[str, Any], info: ModelInfo, request_id: str
                     ) -> GenerationRequest:
    model = check_model(body, info)
    _check_fields(body, COMPLETION_FIELDS, request_id)
    texts, prompts = _completion_prompts(body.get("prompt"), info,
                                         get_field(body, "add_special_tokens", "bool", True))
    logprobs = get_field(body, "logprobs", "int")
    echo = get_field(body, "echo", "bool", False)
    max_tokens = get_field(body, "max_tokens", "int", 16)
    prompt_only = echo and max_tokens == 0  # scoring the prompt: one token is made, not shown
    params = _sampling_params(body, 1 if prompt_only else max_tokens, logprobs, info)
    if echo and logprobs is not None:  # echoed prompt tokens carry logprobs too
        params = _with(params, prompt_logprobs=max(logprobs, params.prompt_logprobs or 0))
    kept = _truncated(prompts, params, info)
    texts = [t if len(k) == len(p) else info.tokenizer.decode(k)  # the echo: what ran
             for t, p, k in zip(texts, prompts, kept, strict=True)]
    prompts = kept
    _check_lengths(prompts, params, info, "prompt")
    return _request(f"cmpl-{request_id}", model, prompts, params, body,
                    echo_texts=tuple(texts) if echo else None, prompt_only=prompt_only)


def parse_chat(body: dict[str, Any], info: ModelInfo, request_id: str) -> GenerationRequest:
    model = check_model(body, info)
    _check_fields(body, CHAT_FIELDS, request_id)
    tools = parse_tools(body, info)
    prompt = chat_prompt(body, info, tools.template_tools)
    max_tokens = get_field(body, "max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", "int")
    params = _sampling_params(body, max_tokens, _chat_logprobs(body), info)
    if tools.constraint is not None:  # tool_choice required or named: a grammar forces it
        if params.structured_outputs is not None:
            raise APIError("tool_choice (required or a named function) and the structured "
                           "output fields both constrain the output; pass only one",
                           param="tool_choice")
        params = _with(params, structured_outputs=tools.constraint)
    if tools.choice is not None and not tools.choice.skip_special_tokens:
        params = _with(params, skip_special_tokens=False)  # the parser reads their markers
    [prompt] = _truncated([prompt], params, info)
    _check_lengths([prompt], params, info, "messages")
    return _request(f"chatcmpl-{request_id}", model, [prompt], params, body,
                    tools=tools.choice)


def chat_prompt(body: dict[str, Any], info: ModelInfo,
                tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of body's messages (and tools) through the chat template."""
    messages = parse_messages(body.get("messages"))
    flags = {name: get_field(body, name, "bool", default) for name, default in
             (("add_generation_prompt", True), ("continue_final_message", False))}
    kwargs = get_field(body, "chat_template_kwargs", "dict")
    template = get_field(body, "chat_template", "str")
    if template is not None and not info.trust_request_chat_template:
        raise APIError("chat_template in a request is refused: the server runs the model's "
                       "template (or --chat-template); start it with "
                       "--trust-request-chat-template to allow one", param="chat_template")
    try:
        return apply_chat_template(info.tokenizer, messages, tools=tools,
                                   chat_template=template or info.chat_template,
                                   chat_template_kwargs=kwargs, **flags)
    except ValueError as e:
        raise APIError(str(e), param=_template_param(str(e))) from None


def _template_param(message: str) -> str:
    """The body field a chat template error is about (messages unless it names another)."""
    for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message",
                 "chat_template"):
        if message.startswith(name):
            return name
    return "messages"


def tokenize(body: dict[str, Any], info: ModelInfo) -> list[int]:
    """/tokenize: token ids of `messages` (chat template) or of `prompt`."""
    check_model(body, info, required=False)
    if "messages" in body:
        return chat_prompt(body, info, template_tools(body))
    prompt = get_field(body, "prompt", "str")
    if prompt is None:
        raise APIError("pass prompt (a string) or messages", param="prompt")
    special = get_field(body, "add_special_tokens", "bool", True)
    return info.tokenizer.encode(prompt, add_special_tokens=special)


def detokenize(body: dict[str, Any], info: ModelInfo) -> str:
    check_model(body, info, required=False)
    tokens = get_field(body, "tokens", "list")
    if tokens is None:
        raise APIError("tokens must be an array of token ids", param="tokens")
    _check_token_ids(tokens, info, "tokens")
    return info.tokenizer.decode(tokens)


def _check_fields(body: dict[str, Any], known: frozenset[str], request_id: str) -> None:
    """Before tokenizing: a client relying on one of UNSUPPORTED must hear it is not
    honoured; fields no endpoint reads (another server's extras, a typo) are logged."""
    for name, instead in UNSUPPORTED.items():
        if body.get(name) is not None:
            raise APIError(f"{name} is not supported by this server: {instead}", param=name)
    ignored = sorted(set(body) - known)
    if ignored:
        log.warning("request %s: the following fields were present in the request but "
                    "ignored: %s", request_id, ", ".join(ignored))


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages with string content; text parts are joined, other parts rejected; an
    assistant's tool calls and a tool result's call id are kept (server.tools)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty array of {role, content} objects",
                       param="messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise APIError(f"{param} must be an object with role and content", param=param)
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise APIError(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                       param=f"{param}.role")
    tool_fields = message_tool_fields(message, param)
    if content is None and "tool_calls" in tool_fields:
        content = ""  # an assistant turn that only called tools
    if isinstance(content, list):
        content = "".join(_text_part(p, f"{param}.content[{j}]") for j, p in enumerate(content))
    if not isinstance(content, str):
        raise APIError(f"{param}.content must be a string or an array of text parts, got "
                       f"{content!r}", param=f"{param}.content")
    return {"role": role, "content": check_text(content, f"{param}.content"), **tool_fields}


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


def _completion_prompts(prompt: Any, info: ModelInfo, add_special_tokens: bool
                        ) -> tuple[list[str], list[list[int]]]:
    """(texts for echo, token ids) of a string, strings, token ids, or lists of token ids;
    `add_special_tokens` (vLLM's field): the tokenizer's BOS and the like on text prompts."""
    if isinstance(prompt, str) or _is_int_list(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) or _is_int_list(p) for p in prompt):
        raise APIError("prompt must be a string, an array of strings, an array of token ids "
                       "or an array of token-id arrays (none empty)", param="prompt")
    if len(prompt) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}",
                       param="prompt")
    if any(p == "" or p == [] for p in prompt):
        raise APIError("prompt must not be empty", param="prompt")
    for p in prompt:
        if isinstance(p, str):
            check_text(p, "prompt")
        else:
            _check_token_ids(p, info, "prompt")
    tokenizer = info.tokenizer
    ids = [tokenizer.encode(p, add_special_tokens=add_special_tokens) if isinstance(p, str)
           else list(p) for p in prompt]
    texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompt]
    return texts, ids


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _check_token_ids(ids: list[Any], info: ModelInfo, param: str) -> None:
    vocab = info.vocab_size
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
        raise APIError(f"{param} must hold token ids in [0, {vocab}) (the model's vocabulary)",
                       param=param)


def _sampling_params(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                     info: ModelInfo) -> SamplingParams:
    kwargs = {name: get_field(body, name, kind) for name, kind in _SAMPLING_FIELDS.items()}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    n = kwargs.get("n", 1)
    if isinstance(n, int) and n > MAX_N:
        raise APIError(f"n must be at most {MAX_N}, got {n}", param="n")
    best_of = get_field(body, "best_of", "int")
    if best_of is not None and best_of != n:
        raise APIError(f"best_of must be null or equal to n ({n}), got {best_of}: ranking "
                       "candidates by likelihood is not supported", param="best_of")
    kwargs["logit_bias"] = _logit_bias(get_field(body, "logit_bias", "dict"))
    kwargs["structured_outputs"] = parse_structured_outputs(body, info)
    try:
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
        params.check_vocab(info.vocab_size)
    except ValueError as e:
        raise APIError(str(e), param=param_of(str(e))) from None
    return params


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


def _with(params: SamplingParams, **changes: Any) -> SamplingParams:
    try:
        return replace(params, **changes)
    except ValueError as e:
        raise APIError(str(e), param=param_of(str(e))) from None


def _truncated(prompts: list[list[int]], params: SamplingParams, info: ModelInfo
               ) -> list[list[int]]:
    """The prompts cut to their last truncate_prompt_tokens tokens (vLLM's field)."""
    try:
        return [params.truncate(ids, info.max_model_len) for ids in prompts]
    except ValueError as e:
        raise APIError(str(e), param="truncate_prompt_tokens") from None


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


def _request(request_id: str, model: str, prompts: list[list[int]], params: SamplingParams,
             body: dict[str, Any], **extra: Any) -> GenerationRequest:
    stream = get_field(body, "stream", "bool", False)
    options = get_field(body, "stream_options", "dict", {})
    include_usage = get_field(options, "include_usage", "bool", False)
    continuous = get_field(options, "continuous_usage_stats", "bool", False)
    get_field(body, "user", "str")
    priority = get_field(body, "priority", "int", 0)
    as_ids = get_field(body, "return_tokens_as_token_ids", "bool", False)
    return GenerationRequest(id=request_id, created=int(time.time()),
                             model=model, prompts=prompts, params=params, stream=stream,
                             include_usage=include_usage and stream,
                             continuous_usage=include_usage and continuous and stream,
                             priority=priority, return_tokens_as_token_ids=as_ids, **extra)
