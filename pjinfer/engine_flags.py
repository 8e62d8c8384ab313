"""Engine arguments on the command line: flags generated from the EngineConfig table.

`pjinfer serve`, `pjinfer generate`, `pjinfer bench ...` and the benchmark server all call
`add_engine_args`, so every engine argument has the same vLLM flag (`--max-model-len`,
`--enable-prefix-caching` / `--no-enable-prefix-caching`, ...) and help everywhere. A flag that
is not given stays None and is left out, so a `--config` file's value, else the engine's
default, stays in force.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pjinfer.engine.config import ENGINE_ARGS, INT_LIST, EngineArg
from pjinfer.plugins import PLUGIN_GROUP, load_plugins, parse_plugin_names
from pjinfer.run_config import RunConfig, load_run_config

GROUP_TITLE = "engine arguments (vLLM names)"


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool = False,
                    exclude: Iterable[str] = ()) -> None:
    """`--config` and one flag per engine argument; `positional_model` also takes MODEL as
    `pjinfer serve MODEL` does. `exclude` names arguments the caller sets its own way."""
    group = parser.add_argument_group(GROUP_TITLE)
    group.add_argument("--config", default=None, metavar="TOML",
                       help="TOML run config; flags override its values")
    group.add_argument("--plugins", type=parse_plugin_names, default=None, metavar="A,B",
                       help=f"plugins to load ({PLUGIN_GROUP!r} entry points; default: all "
                       "installed)")
    if positional_model:  # SUPPRESS: a missing MODEL does not undo --model
        group.add_argument("model", nargs="?", metavar="MODEL", default=argparse.SUPPRESS,
                           help=ENGINE_ARGS["model"].help)
    skipped = set(exclude)
    for arg in ENGINE_ARGS.values():
        if arg.name not in skipped:
            _add_flag(group, arg)


def _add_flag(group: argparse._ArgumentGroup, arg: EngineArg) -> None:
    text = arg.help + _default_note(arg)
    if arg.type is bool:
        group.add_argument(arg.flag, dest=arg.name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
    elif arg.type == INT_LIST:
        group.add_argument(arg.flag, dest=arg.name, type=int, nargs="+", default=None,
                           metavar="N", help=text)
    else:
        group.add_argument(arg.flag, dest=arg.name, type=arg.type, choices=arg.choices,
                           default=None, metavar=None if arg.choices else arg.name.upper(),
                           help=text)


def _default_note(arg: EngineArg) -> str:
    """The engine's default, where the help text does not already say what None means."""
    if arg.default is None:
        return ""
    if arg.type is bool:
        return f" (default: {'on' if arg.default else 'off'})"
    return f" (default: {arg.default})"


def given_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig keyword arguments for the engine flags given on the command line."""
    given = vars(args)
    return {name: given[name] for name in ENGINE_ARGS if given.get(name) is not None}


def run_config_from_flags(args: argparse.Namespace) -> RunConfig:
    """The `--config` file (or an empty config) with every engine flag given laid over it.
    Plugins load first (pjinfer.plugins): they may add the policy or architecture named."""
    load_plugins(getattr(args, "plugins", None))
    path = getattr(args, "config", None)
    config = load_run_config(path) if path else RunConfig()
    return config.with_engine_args(given_engine_args(args))
