"""The `pjinfer` command: `serve`, `generate`, `bench`, `convert`.

Engine flags keep vLLM's names and are declared once (ENGINE_FLAGS), for both `serve` and
`generate`; each maps to an EngineConfig field and, through run_config.SCHEMA, to its TOML
section, so a flag given on the command line overrides the same key of a `--config` file.
A bad flag or value ends with one line naming the flag and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pjinfer import __version__
from pjinfer.run_config import SCHEMA, RunConfig, RunConfigError, load_run_config

log = logging.getLogger("pjinfer")
BOOL = "bool"  # --flag / --no-flag

# flag -> (EngineConfig field, type, help)
ENGINE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--served-model-name": ("served_model_name", str, "model name clients send (default: "
                            "the model folder's name)"),
    "--tokenizer": ("tokenizer", str, "tokenizer folder (default: the model folder)"),
    "--dtype": ("dtype", str, "auto, float32, bfloat16 or float16"),
    "--load-format": ("load_format", str, "auto, safetensors, or dummy (random weights)"),
    "--seed": ("seed", int, "seed of the engine's random state"),
    "--max-model-len": ("max_model_len", int, "longest prompt + completion, in tokens"),
    "--max-logprobs": ("max_logprobs", int, "largest logprobs/top_logprobs a request may ask"),
    "--tensor-parallel-size": ("tensor_parallel_size", int, "devices each replica spans"),
    "--block-size": ("block_size", int, "tokens per KV cache block (power of two)"),
    "--gpu-memory-utilization": ("gpu_memory_utilization", float,
                                 "fraction of accelerator memory pjinfer may use, in (0, 1]"),
    "--enable-prefix-caching": ("enable_prefix_caching", BOOL, "reuse KV blocks of shared "
                                "prompt prefixes"),
    "--num-kv-blocks": ("num_kv_blocks", int, "fix the KV cache size in blocks"),
    "--kv-cache-memory": ("kv_cache_memory", int, "bytes for the KV cache"),
    "--max-num-seqs": ("max_num_seqs", int, "most sequences in one step"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of one step"),
    "--enable-chunked-prefill": ("enable_chunked_prefill", BOOL, "split long prompts over "
                                 "steps (default on)"),
    "--async-scheduling": ("async_scheduling", BOOL, "schedule step t+1 while step t runs "
                           "(default on)"),
    "--scheduling-policy": ("scheduling_policy", str, "fcfs or priority"),
    "--max-waiting-requests": ("max_waiting_requests", int, "queue length past which requests "
                               "get 503"),
    "--request-timeout": ("request_timeout", float, "seconds a request may live"),
    "--warmup": ("warmup", BOOL, "compile every step shape at start-up (default on)"),
    "--compilation-cache-dir": ("compilation_cache_dir", str, "JAX persistent compilation "
                                "cache folder"),
}
SERVER_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--host": ("host", str, "address to bind (default 127.0.0.1)"),
    "--port": ("port", int, "port to bind (default 8000)"),
    "--api-key": ("api_key", str, "require 'Authorization: Bearer KEY' on /v1/* (also env "
                  "PJINFER_API_KEY or VLLM_API_KEY)"),
    "--drain-timeout": ("drain_timeout", float, "seconds in-flight requests get at shutdown"),
    "--log-level": ("log_level", str, "debug, info, warning or error"),
}
# EngineConfig field -> (TOML section, key)
_FIELD_TO_KEY = {field: (section, key) for section, keys in SCHEMA.items()
                 for key, (field, _) in keys.items() if field is not None}
_FIELD_TO_FLAG = {field: flag for flag, (field, _, _) in ENGINE_FLAGS.items()}
_FIELD_TO_FLAG["model"] = "MODEL"
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
    _add_common(serve)
    _add_flags(serve, SERVER_FLAGS)
    gen = sub.add_parser("generate", help="complete one prompt and print the result",
                         argument_default=argparse.SUPPRESS)
    gen.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    gen.add_argument("--model", dest="model", help="local Hugging Face model folder "
                     "(default: the embedded demo model)")
    _add_common(gen, positional_model=False)
    _add_sampling(gen)
    for name, module in DISPATCH.items():
        sub.add_parser(name, help=f"runs {module}.main (pjinfer {name} --help)", add_help=False)
    return parser


def _add_common(parser: argparse.ArgumentParser, *, positional_model: bool = True) -> None:
    if positional_model:
        parser.add_argument("model", nargs="?", metavar="MODEL", help="local Hugging Face "
                            "model folder (default: the embedded demo model)")
    parser.add_argument("--config", help="TOML run config; flags override its values")
    _add_flags(parser, ENGINE_FLAGS)


def _add_flags(parser: argparse.ArgumentParser, flags: dict[str, tuple[str, Any, str]]) -> None:
    for flag, (dest, kind, help_text) in flags.items():
        if kind == BOOL:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=kind, help=help_text,
                                metavar=dest.upper())


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
    config = load_run_config(args.config) if getattr(args, "config", None) else RunConfig()
    given = vars(args)
    if given.get("model") is not None:
        config = config.with_overrides("model", {"path": given["model"]})
    for field, _, _ in ENGINE_FLAGS.values():
        if field in given:
            section, key = _FIELD_TO_KEY[field]
            config = config.with_overrides(section, {key: given[field]})
    server = {dest: given[dest] for _, (dest, _, _) in SERVER_FLAGS.items() if dest in given}
    return config.with_overrides("server", server) if server else config


def engine_config(config: RunConfig):
    """EngineConfig from a run config; a bad value is a UsageError naming flag and key."""
    from pjinfer.engine.config import EngineConfig

    try:
        return EngineConfig.from_kwargs(**config.engine_args())
    except ValueError as e:
        raise UsageError(_name_source(str(e), config)) from None


def _name_source(message: str, config: RunConfig) -> str:
    """Prefix an EngineConfig message with the flag (and TOML key) it is about."""
    field = message.split(" ", 1)[0].rstrip(":")
    if field not in _FIELD_TO_FLAG:
        return message
    section, key = _FIELD_TO_KEY.get(field, ("model", "path"))
    where = f" ([{section}] {key} in {config.path})" if config.path and key in \
        config.sections.get(section, {}) else ""
    return f"{_FIELD_TO_FLAG[field]}{where}: {message}"


def server_args(config: RunConfig) -> dict[str, Any]:
    args = config.server_args()
    if args["api_key"] is None:
        args["api_key"] = os.environ.get("PJINFER_API_KEY") or os.environ.get("VLLM_API_KEY")
    if args["log_level"].lower() not in LOG_LEVELS:
        raise UsageError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got "
                         f"{args['log_level']!r}")
    if not 0 < args["port"] < 65536:
        raise UsageError(f"--port must be in [1, 65535], got {args['port']}")
    return args


def set_memory_fraction(gpu_memory_utilization: float) -> None:
    """XLA reads its GPU memory pool size when the backend starts: set it before that, unless
    the user already chose (setting both the old and the new variable is an XLA error)."""
    if not {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"} & set(os.environ):
        os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(gpu_memory_utilization)


# ---- commands -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    config = run_config_from_args(args)
    srv = server_args(config)
    _setup_logging(srv["log_level"])
    ecfg = engine_config(config)
    set_memory_fraction(ecfg.gpu_memory_utilization)
    check_devices(config)
    from pjinfer.engine.async_engine import AsyncEngine
    from pjinfer.server.serve import serve

    log.info("loading %s (dtype %s, load_format %s)%s", ecfg.model or "the demo model",
             ecfg.dtype, ecfg.load_format, "; then compiling step shapes" if ecfg.warmup else "")
    engine = _build(AsyncEngine, ecfg)
    serve(engine, host=srv["host"], port=srv["port"], api_key=srv["api_key"],
          drain_timeout=srv["drain_timeout"], log_level=srv["log_level"])
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
    if parallel.data_parallel_size > 1:
        raise UsageError("data_parallel_size > 1: `pjinfer serve` runs one engine replica; "
                         "start one server per replica behind a load balancer")
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
    config = run_config_from_args(args)
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


COMMANDS = {"serve": cmd_serve, "generate": cmd_generate}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DISPATCH:
        return _dispatch(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (UsageError, RunConfigError) as e:
        return _fail(args.command, str(e))


def _fail(command: str, message: str) -> NoReturn | int:
    print(f"pjinfer {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
