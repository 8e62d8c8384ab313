"""The `pjinfer` command: `serve`, `generate`, `demo-path`, `bench`, `convert`.

Engine flags keep vLLM's names and are generated from the EngineConfig table
(pjinfer.engine_flags), for both `serve` and `generate`; each maps to an EngineConfig field and
to its TOML key, so a flag given on the command line overrides the same key of a `--config`
file. A bad flag or value ends with one line naming the flag and exit code 2, never a traceback.
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
from pjinfer.engine.compilation_cache import default_cache_dir
from pjinfer.engine.config import ENGINE_ARGS, EngineConfig
from pjinfer.engine_flags import add_engine_args, run_config_from_flags
from pjinfer.errors import UsageError
from pjinfer.plugins import PluginError
from pjinfer.run_config import RunConfig, RunConfigError
from pjinfer.server_flags import SERVER_FLAGS, add_server_flags, server_args

log = logging.getLogger("pjinfer")

DISPATCH = {"bench": "pjinfer.benchmarks.cli", "convert": "pjinfer.sharding.convert"}


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
    add_server_flags(serve)
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


# ---- commands -----------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    config = with_default_cache(run_config_from_args(args))
    srv = server_args(config)
    _setup_logging(srv["log_level"])
    ecfg = engine_config(config)
    from pjinfer.engine.kv_budget import claim_device_memory

    claim_device_memory(ecfg.gpu_memory_utilization)  # before check_devices starts JAX
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
                            allow_runtime_lora_updating=bool(srv["allow_runtime_lora_updating"]),
                            chat_template=srv["chat_template"],
                            trust_request_chat_template=bool(srv["trust_request_chat_template"]))
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
    from pjinfer.llm import LLM  # its engine claims the device memory first

    engine_args = config.engine_args()
    engine_args.setdefault("warmup", False)
    llm = _build(lambda _: LLM(**engine_args), ecfg)
    try:
        if args.chat:
            outputs = llm.chat([{"role": "user", "content": args.prompt}], params,
                               use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
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
