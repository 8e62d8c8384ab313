"""The server flags of `pjinfer serve` (those that are not engine arguments), and their
validation into the arguments of `ServerOptions`: one table for the flags and the TOML
`[server]` keys, checked once whichever of the two gave them."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pjinfer.errors import UsageError
from pjinfer.run_config import RunConfig


def _origins(text: str) -> list[str]:
    """--allowed-origins takes a JSON list, as vLLM's does."""
    try:
        origins = json.loads(text)
    except json.JSONDecodeError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise argparse.ArgumentTypeError(f"must be a JSON list of strings such as "
                                         f"'[\"https://ui.example\"]', got {text!r}")
    return origins


# Flags of `pjinfer serve` that are not engine arguments: flag -> (dest, type, help)
SERVER_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--host": ("host", str, "address to bind (default 127.0.0.1)"),
    "--port": ("port", int, "port to bind (default 8000)"),
    "--api-key": ("api_key", str, "require 'Authorization: Bearer KEY' on /v1/*; repeat for "
                  "several keys, each with its own rate limit (also env PJINFER_API_KEY or "
                  "VLLM_API_KEY)"),
    "--api-key-file": ("api_key_file", str, "file of more API keys, one per line"),
    "--rate-limit-requests": ("rate_limit_requests", float, "requests per second per API key "
                              "(one global bucket without keys)"),
    "--rate-limit-burst": ("rate_limit_burst", float, "requests at once per key (default: rate)"),
    "--rate-limit-tokens": ("rate_limit_tokens", float, "prompt + max_tokens per second per key"),
    "--max-num-queued-requests": ("max_num_queued_requests", int, "requests admitted and not "
                                  "finished yet (waiting or running)"),
    "--max-num-queued-tokens": ("max_num_queued_tokens", int, "prompt tokens of those"),
    "--drain-timeout": ("drain_timeout", float, "seconds in-flight requests get at shutdown"),
    "--log-level": ("log_level", str, "debug, info, warning or error"),
    "--max-request-bytes": ("max_request_bytes", int, "largest request body accepted; larger "
                            "ones get 413 (default 16 MiB)"),
    "--engine-stuck-timeout": ("engine_stuck_timeout", float, "/health answers 503 once the "
                               "engine has had work and finished no step for this many "
                               "seconds (default 180)"),
    "--allowed-origins": ("allowed_origins", _origins, "CORS: JSON list of allowed origins, "
                          "e.g. '[\"*\"]' (default: no CORS headers)"),
    "--ssl-keyfile": ("ssl_keyfile", str, "serve HTTPS with this private key file"),
    "--ssl-certfile": ("ssl_certfile", str, "serve HTTPS with this certificate file"),
    "--enable-auto-tool-choice": ("enable_auto_tool_choice", bool, "let the model decide "
                                  "when to call tools (tool_choice \"auto\", the default with "
                                  "tools); needs --tool-call-parser"),
    "--tool-call-parser": ("tool_call_parser", str, "how tool calls are read from the model's "
                           "output: hermes, llama3_json or mistral (the model's format)"),
    "--admin-api-key": ("admin_api_key", str, "enable the admin routes (/v1/admin/models/load, "
                        "unload, replace; /sleep, /wake_up, /is_sleeping), which need "
                        "'Authorization: Bearer KEY'"),
    "--lora-modules": ("lora_modules", str, "LoRA adapters to serve (with --enable-lora), as "
                       "name=path ...: each name is a model in /v1/models"),
    "--allow-runtime-lora-updating": ("allow_runtime_lora_updating", bool, "allow POST "
                                      "/v1/load_lora_adapter and /v1/unload_lora_adapter "
                                      "(also env PJINFER_ALLOW_RUNTIME_LORA_UPDATING=1)"),
    "--chat-template": ("chat_template", str, "a Jinja chat template, or the file holding one, "
                        "used for chat requests instead of the model's own"),
    "--trust-request-chat-template": ("trust_request_chat_template", bool, "accept a chat "
                                      "request's own chat_template field (else it is a 400): "
                                      "a template runs on the server"),
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server arguments", "over a rate limit the server answers "
                                      "429, past a queue cap 503, both with Retry-After")
    for flag, (dest, kind, help_text) in SERVER_FLAGS.items():
        if kind is bool:
            group.add_argument(flag, dest=dest, action="store_true", help=help_text,
                               default=argparse.SUPPRESS)
        elif flag == "--lora-modules":
            group.add_argument(flag, dest=dest, nargs="+", metavar="NAME=PATH", help=help_text)
        else:
            group.add_argument(flag, dest=dest, type=kind, help=help_text, metavar=dest.upper(),
                               action="append" if flag == "--api-key" else "store")


def server_args(config: RunConfig) -> dict[str, Any]:
    args = config.server_args()
    args["api_keys"] = _api_keys(args)
    if args["log_level"].lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got "
                         f"{args['log_level']!r}")
    if not 0 < args["port"] < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {args['port']}")
    _check_server_options(args)
    args["admission"] = _admission(args)
    args["lora_modules"] = _lora_modules(args["lora_modules"])
    args["chat_template"] = read_chat_template(args["chat_template"])
    return args


def read_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or the flag's text itself when it is a Jinja template
    (as vLLM reads it); a template that does not compile is a usage error now, not a 400 on
    every chat request later."""
    if given is None:
        return None
    if not isinstance(given, str) or not given.strip():
        raise UsageError(f"--chat-template must be a Jinja template or a file holding one, "
                         f"got {given!r}")
    if "{{" not in given and "{%" not in given:
        try:
            given = Path(given).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {given!r} is neither a readable file nor a "
                             f"Jinja template: {e}") from None
    import jinja2

    try:  # the environment transformers renders chat templates in (its tags: break, generation)
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # another transformers: requests will report a broken template
        return given
    try:
        _compile_jinja_template(given)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"--chat-template does not compile: {e} (line {e.lineno})") from None
    return given


def _lora_modules(given: Any) -> tuple[tuple[str, str], ...]:
    """--lora-modules name=path ... (in TOML, a list of such strings)."""
    from pjinfer.server.lora import parse_lora_module

    if given is None:
        return ()
    if not isinstance(given, list) or not all(isinstance(g, str) for g in given):
        raise UsageError(f"lora_modules must be a list of 'name=path' strings, got {given!r}")
    try:
        return tuple(parse_lora_module(g) for g in given)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _api_keys(args: dict[str, Any]) -> list[str]:
    """--api-key (once or repeated; a string or a list in TOML), then --api-key-file; else
    the environment's key."""
    from pjinfer.server.admission import read_api_keys

    given = args["api_key"]
    keys = [given] if isinstance(given, str) else list(given or [])
    if not all(isinstance(k, str) and k for k in keys):
        raise UsageError(f"--api-key must be a non-empty string (or, in TOML, a list of them), "
                         f"got {given!r}")
    if args["api_key_file"] is not None:
        try:
            keys += read_api_keys(args["api_key_file"])
        except ValueError as e:
            raise UsageError(str(e)) from None
    env = os.environ.get("PJINFER_API_KEY") or os.environ.get("VLLM_API_KEY")
    return keys or ([env] if env else [])


def _admission(args: dict[str, Any]) -> Any:
    from pjinfer.server.admission import AdmissionLimits

    names = ("rate_limit_requests", "rate_limit_burst", "rate_limit_tokens",
             "max_num_queued_requests", "max_num_queued_tokens")
    try:
        return AdmissionLimits(**{name: args[name] for name in names})
    except ValueError as e:
        raise UsageError(str(e)) from None


def _check_server_options(args: dict[str, Any]) -> None:
    origins = args["allowed_origins"]
    if origins is not None and not (isinstance(origins, list)
                                    and all(isinstance(o, str) for o in origins)):
        raise UsageError(f"allowed_origins must be a list of strings, got {origins!r}")
    for name in ("max_request_bytes", "engine_stuck_timeout"):
        if args[name] is not None and args[name] <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {args[name]}")
    if args["admin_api_key"] is not None and not (isinstance(args["admin_api_key"], str)
                                                   and args["admin_api_key"]):
        raise UsageError("--admin-api-key must be a non-empty string (an empty key would leave "
                         "the admin routes off without saying so)")
    if (args["ssl_keyfile"] is None) != (args["ssl_certfile"] is None):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    from pjinfer.tool_parsers import check_tool_options

    try:
        check_tool_options(bool(args["enable_auto_tool_choice"]), args["tool_call_parser"])
    except ValueError as e:
        raise UsageError(str(e)) from None
