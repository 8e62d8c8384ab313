"""The `pjinfer` command: `serve`, `generate`, `demo-path`, `bench`, `convert`.

Engine flags keep vLLM's names and are generated from the EngineConfig table
(pjinfer.engine_flags), for both `serve` and `generate`; each maps to an EngineConfig field and
to its TOML key, so a flag given on the command line overrides the same key of a `--config`
file. A bad flag or value ends with one line naming the flag and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pjinfer import __version__
from pjinfer.engine.compilation_cache import default_cache_dir
from pjinfer.engine.config import ENGINE_ARGS, EngineConfig
from pjinfer.engine_flags import add_engine_args, run_config_from_flags
from pjinfer.plugins import PluginError
from pjinfer.run_config import RunConfig, RunConfigError

log = logging.getLogger("pjinfer")

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
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DISPATCH = {"bench": "pjinfer.benchmarks.cli", "convert": "pjinfer.sharding.convert"}


class UsageError(Exception):
    """A bad flag or config value; main prints it as one line and exits 2."""


# ---- parser -------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pjinfer", description="LLM inference on JAX/XLA.")
    parser.add_argument("--version", action="version", version=f"pjinfer {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API",
                           argument_default=argparse.SUPPRESS)
    add_engine_args(serve, positional_model=True)
    serve.add_argument("--data-parallel-size", "-dp", dest="data_parallel_size", type=int,
                       metavar="N", help="engine replicas in this server, each on its own "
                       "tensor-parallel-size devices (default 1)")
    _add_server_flags(serve)
    gen = sub.add_parser("generate", help="complete one prompt and print the result",
                         argument_default=argparse.SUPPRESS)
    gen.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    add_engine_args(gen)
    _add_sampling(gen)
    sub.add_parser("demo-path", help="print the demo model's folder (config.json, "
                   "tokenizer.json), e.g. for another tool's --tokenizer")
    for name, module in DISPATCH.items():
        sub.add_parser(name, help=f"runs {module}.main (pjinfer {name} --help)", add_help=False)
    return parser


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
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


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of this request's sampling")
    parser.add_argument("--n", type=int, default=1, help="completions to return")
    parser.add_argument("--stop", action="append", default=None, help="stop string "
                        "(repeatable)")
    parser.add_argument("--chat", action="store_true", default=False,
                        help="send the prompt as a user message through the chat template")


# ---- config assembly ----------------------------------------------------------------------
def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """The --config file (or an empty config) with every given flag laid over it."""
    config = run_config_from_flags(args)
    given = vars(args)
    server = {dest: given[dest] for _, (dest, _, _) in SERVER_FLAGS.items() if dest in given}
    config = config.with_overrides("server", server) if server else config
    if given.get("data_parallel_size") is not None:
        config = config.with_overrides("parallel",
                                       {"data_parallel_size": given["data_parallel_size"]})
    return config


def with_default_cache(config: RunConfig) -> RunConfig:
    """The run config, with the commands' compilation cache folder (`default_cache_dir`) where
    neither flag nor file chose one (an empty folder, from either, turns the cache off)."""
    path = default_cache_dir()
    if path is None or "compilation_cache_dir" in config.engine_args():
        return config
    return config.with_overrides("compilation", {"compilation_cache_dir": path})


def engine_config(config: RunConfig) -> EngineConfig:
    """EngineConfig from a run config; a bad value is a UsageError naming flag and key."""
    try:
        return EngineConfig.from_kwargs(**config.engine_args())
    except ValueError as e:
        raise UsageError(_name_source(str(e), config)) from None


def _name_source(message: str, config: RunConfig) -> str:
    """Prefix an EngineConfig message with the flag (and TOML key) it is about."""
    arg = ENGINE_ARGS.get(message.split(" ", 1)[0].rstrip(":"))
    if arg is None:
        return message
    where = f" ([{arg.section}] {arg.key} in {config.path})" if config.path and arg.key in \
        config.sections.get(arg.section, {}) else ""
    return f"{arg.flag}{where}: {message}"


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
    return args


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
    if (args["ssl_keyfile"] is None) != (args["ssl_certfile"] is None):
        raise UsageError("--ssl-keyfile and --ssl-certfile go together: give both or neither")
    from pjinfer.tool_parsers import check_tool_options

    try:
        check_tool_options(bool(args["enable_auto_tool_choice"]), args["tool_call_parser"])
    except ValueError as e:
        raise UsageError(str(e)) from None


def set_memory_fraction(gpu_memory_utilization: float) -> None:
    """XLA reads its GPU memory pool size when the backend starts: set it before that, unless
    the user already chose (setting both the old and the new variable is an XLA error)."""
    if not {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"} & set(os.environ):
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(gpu_memory_utilization)


# ---- commands -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    config = with_default_cache(run_config_from_args(args))
    srv = server_args(config)
    _setup_logging(srv["log_level"])
    ecfg = engine_config(config)
    set_memory_fraction(ecfg.gpu_memory_utilization)
    check_devices(config)
    from pjinfer.server.app import ServerOptions
    from pjinfer.server.pool_config import build_engine, build_pool
    from pjinfer.server.serve import serve

    given = {k: srv[k] for k in ("drain_timeout", "max_request_bytes",
                                 "engine_stuck_timeout") if srv[k] is not None}
    options = ServerOptions(**given, allowed_origins=tuple(srv["allowed_origins"] or ()),
                            api_keys=tuple(srv["api_keys"]), admission=srv["admission"],
                            enable_auto_tool_choice=bool(srv["enable_auto_tool_choice"]),
                            tool_call_parser=srv["tool_call_parser"],
                            admin_api_key=srv["admin_api_key"], lora_modules=srv["lora_modules"],
                            allow_runtime_lora_updating=bool(srv["allow_runtime_lora_updating"]))
    if config.models:  # a model pool: engines load in the server's start-up
        try:
            engine = build_pool(config)
        except ValueError as e:
            raise UsageError(str(e)) from None
    else:
        log.info("loading %s (dtype %s, load_format %s)%s", ecfg.model or "the demo model",
                 ecfg.dtype, ecfg.load_format,
                 "; then compiling step shapes" if ecfg.warmup else "")
        engine = _build(lambda c: build_engine(c, config.parallel.data_parallel_size), ecfg)
    serve(engine, options, host=srv["host"], port=srv["port"], log_level=srv["log_level"],
          ssl_keyfile=srv["ssl_keyfile"], ssl_certfile=srv["ssl_certfile"])
    return 0


def check_devices(config: RunConfig) -> None:
    """Multi-host start-up, then: do the devices this run asks for exist?"""
    parallel = config.parallel
    import jax

    from pjinfer.sharding.distributed import initialize

    # The config's values first, else PJINFER_COORDINATOR_ADDRESS / _NUM_PROCESSES / _PROCESS_ID.
    initialize(parallel.coordinator_address,
               parallel.num_processes if parallel.num_processes > 1 else None,
               parallel.process_id if parallel.num_processes > 1 else None)
    available = jax.device_count()
    if parallel.world_size > available:
        raise UsageError(
            f"--tensor-parallel-size {parallel.tensor_parallel_size} x data_parallel_size "
            f"{parallel.data_parallel_size} needs {parallel.world_size} devices but only "
            f"{available} {jax.default_backend()} device(s) are visible; lower them")


def _build(factory: Any, ecfg: Any) -> Any:
    """Model-loading problems (missing files, impossible shapes) are usage errors."""
    try:
        return factory(ecfg)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    config = with_default_cache(run_config_from_args(args))
    _setup_logging("warning")
    params = _sampling_params(args)
    ecfg = engine_config(config)
    set_memory_fraction(ecfg.gpu_memory_utilization)
    from pjinfer.llm import LLM

    engine_args = config.engine_args()
    engine_args.setdefault("warmup", False)
    llm = _build(lambda _: LLM(**engine_args), ecfg)
    try:
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            outputs = llm.generate(args.prompt, params)
    except ValueError as e:
        raise UsageError(str(e)) from None
    _print_outputs(outputs[0].outputs)
    return 0


def _sampling_params(args: argparse.Namespace):
    from pjinfer.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.sampling_seed, n=args.n,
                              stop=args.stop)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        flag = "--sampling-seed" if field == "seed" else "--" + field.replace("_", "-")
        raise UsageError(f"{flag}: {e}") from None


def _print_outputs(completions: Sequence[Any]) -> None:
    if len(completions) == 1:
        print(completions[0].text)
        return
    for c in completions:
        print(f"--- completion {c.index} ({c.finish_reason}) ---")
        print(c.text)


def _dispatch(command: str, argv: list[str]) -> int:
    """`pjinfer bench|convert ...` -> that module's main(argv), imported only when used."""
    module_name = DISPATCH[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not module_name.startswith(e.name):
            raise
        print(f"pjinfer {command}: error: {module_name} is not part of this installation "
              f"(no module {e.name!r}); reinstall pjinfer from a checkout that has it",
              file=sys.stderr)
        return 2
    result = module.main(argv)
    return result if isinstance(result, int) else 0


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU" noise


def cmd_demo_path(args: argparse.Namespace) -> int:
    """The folder `pjinfer serve` with no model serves from: tools that tokenize on their own
    side (lm-eval, guidellm) load the same tokenizer from it."""
    from pjinfer.demo import DEMO_MODEL_DIR

    print(DEMO_MODEL_DIR)
    return 0


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate, "demo-path": cmd_demo_path}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # transformers advises at import that "PyTorch was not found": pjinfer uses only its
    # tokenizers, so that line would read as a problem with the install (a user's setting wins)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    if argv and argv[0] in DISPATCH:
        return _dispatch(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, RunConfigError, PluginError) as e:
        return _fail(args.command, str(e))


def _fail(command: str, message: str) -> NoReturn | int:
    print(f"pjinfer {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
