"""TOML run configs: one file says which model to serve, how to shard it, and how to serve it.

A run config is read with `tomllib`, checked key by key against one schema table (so a typo
names its file, section and key and lists the valid keys) and turned into `EngineConfig`
keyword arguments plus server arguments. The engine keys are generated from the EngineConfig
table (each argument's section and key), so they cannot drift from the flags. Cross-field
checks (does tensor_parallel_size divide the heads, do the devices exist) belong where the
engine is built, not here.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pjinfer.engine.config import ENGINE_ARGS, INT_LIST, SECTIONS

# TOML keys that are not engine arguments: section -> key -> type
_OTHER_KEYS: dict[str, dict[str, type]] = {
    "parallel": {"data_parallel_size": int, "coordinator_address": str, "num_processes": int,
                 "process_id": int},
    "server": {"host": str, "port": int, "api_key": (str, list), "api_key_file": str,
               "drain_timeout": float, "log_level": str, "max_request_bytes": int,
               "engine_stuck_timeout": float, "allowed_origins": list, "ssl_keyfile": str,
               "ssl_certfile": str, "rate_limit_requests": float, "rate_limit_burst": float,
               "rate_limit_tokens": float, "max_num_queued_requests": int,
               "max_num_queued_tokens": int, "enable_auto_tool_choice": bool,
               "tool_call_parser": str, "admin_api_key": str, "lora_modules": list,
               "allow_runtime_lora_updating": bool, "chat_template": str,
               "trust_request_chat_template": bool},
    "pool": {"repository": str, "memory_bytes": int},
}
# keys of one [[models]] entry besides engine arguments (pjinfer.server.model_pool.ModelSpec)
MODEL_ENTRY_KEYS: dict[str, type] = {"name": str, "path": str, "version": str, "lazy": bool,
                                     "idle_unload_s": float, "memory_share": float}


def _schema() -> dict[str, dict[str, tuple[str | None, Any]]]:
    """section -> key -> (EngineConfig field, or None for a key that is not one; type)."""
    schema: dict[str, dict[str, tuple[str | None, Any]]] = {
        section: {} for section in (*SECTIONS, *_OTHER_KEYS)}
    for arg in ENGINE_ARGS.values():
        schema[arg.section][arg.key] = (arg.name, arg.type)
    for section, keys in _OTHER_KEYS.items():
        schema[section].update({key: (None, kind) for key, kind in keys.items()})
    return schema


SCHEMA = _schema()
# None: the server's own default (pjinfer.server.app.ServerOptions), or no limit
SERVER_DEFAULTS: dict[str, Any] = {**dict.fromkeys(_OTHER_KEYS["server"]), "host": "127.0.0.1",
                                   "port": 8000, "drain_timeout": 30.0, "log_level": "info"}


class RunConfigError(ValueError):
    """A run config file that cannot be used as written; the message names file, section, key."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Replica and multi-host layout; tensor parallelism itself is an engine argument."""

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    coordinator_address: str | None = None  # "host:port" of process 0, multi-host only
    num_processes: int = 1
    process_id: int = 0
    enable_expert_parallel: bool = False  # engine argument too; MoE experts whole per tp shard

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size", "num_processes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={self.num_processes}), "
                             f"got {self.process_id}")
        if self.num_processes > 1 and not self.coordinator_address:
            raise ValueError("num_processes > 1 needs coordinator_address = \"host:port\" of "
                             "process 0")

    @property
    def world_size(self) -> int:
        """Devices one run needs: every data-parallel replica holds tensor_parallel_size."""
        return self.tensor_parallel_size * self.data_parallel_size


@dataclass(frozen=True, slots=True)
class RunConfig:
    """A parsed run config: `sections[section][key] = value`, only the keys the file set."""

    path: str | None = None
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    models: tuple[dict[str, Any], ...] = ()  # [[models]]: a model pool (keys as written)

    def engine_args(self) -> dict[str, Any]:
        """EngineConfig keyword arguments for every engine key the file set."""
        args = {}
        for section, values in self.sections.items():
            for key, value in values.items():
                engine_name = SCHEMA[section][key][0]
                if engine_name is not None:
                    args[engine_name] = value
        return args

    def server_args(self) -> dict[str, Any]:
        """SERVER_DEFAULTS' keys: the file's values over the defaults."""
        return {**SERVER_DEFAULTS, **self.sections.get("server", {})}

    @property
    def parallel(self) -> ParallelConfig:
        try:
            return ParallelConfig(**self.sections.get("parallel", {}))
        except ValueError as e:
            raise RunConfigError(f"{self.path}: [parallel] {e}") from None

    def with_overrides(self, section: str, values: dict[str, Any]) -> RunConfig:
        """A copy where `values` (e.g. command-line flags) replace the file's keys."""
        for key, value in values.items():
            _check_value(self.path, section, key, value)
        merged = {s: dict(v) for s, v in self.sections.items()}
        merged.setdefault(section, {}).update(values)
        return RunConfig(self.path, merged, self.models)

    def with_engine_args(self, kwargs: dict[str, Any]) -> RunConfig:
        """A copy where EngineConfig keyword arguments replace the file's keys for them."""
        config = self
        for name, value in kwargs.items():
            arg = ENGINE_ARGS[name]
            config = config.with_overrides(arg.section, {arg.key: value})
        return config


def load_run_config(path: str | Path) -> RunConfig:
    """Read and check a TOML run config; raises RunConfigError naming file, section and key."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RunConfigError(f"run config {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise RunConfigError(f"{path}: not valid TOML: {e}") from None
    config = parse_run_config(raw, source=str(path))
    for values in (config.sections.get("model", {}), config.sections.get("pool", {}),
                   *config.models):
        _resolve_paths(values, path.parent)
    config.parallel  # noqa: B018 - checks the [parallel] combination now, not at first use
    return config


def _resolve_paths(model: dict[str, Any], base: Path) -> None:
    """A relative model/tokenizer path means relative to the config file, if it exists there,
    so `configs/x.toml` can name `models/x` wherever pjinfer is started from."""
    for key in ("path", "tokenizer", "repository"):
        value = model.get(key)
        if value and not Path(value).is_absolute() and (base / value).exists():
            model[key] = str(base / value)


def parse_run_config(raw: dict[str, Any], *, source: str = "<config>") -> RunConfig:
    """Check a decoded TOML document against SCHEMA."""
    sections: dict[str, dict[str, Any]] = {}
    models = _parse_models(raw.pop("models", None), source) if "models" in raw else ()
    for section, values in raw.items():
        if section not in SCHEMA:
            raise RunConfigError(f"{source}: unknown section [{section}]; valid sections: "
                                 f"{', '.join(f'[{s}]' for s in SCHEMA)}")
        if not isinstance(values, dict):
            raise RunConfigError(f"{source}: {section} must be a [{section}] table")
        for key, value in values.items():
            _check_value(source, section, key, value)
        sections[section] = dict(values)
    return RunConfig(source, sections, models)


def _parse_models(entries: Any, source: str) -> tuple[dict[str, Any], ...]:
    """`[[models]]` tables: MODEL_ENTRY_KEYS plus engine arguments by their field names."""
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise RunConfigError(f"{source}: models must be an array of tables ([[models]])")
    for n, entry in enumerate(entries):
        if not isinstance(entry.get("name"), str):
            raise RunConfigError(f"{source}: [[models]] entry {n} needs name = \"...\"")
        for key, value in entry.items():
            kind = MODEL_ENTRY_KEYS.get(key) or (ENGINE_ARGS[key].type if key in ENGINE_ARGS
                                                  else None)
            if kind is None:
                raise RunConfigError(
                    f"{source}: unknown key {key!r} in [[models]] {entry['name']!r}; valid "
                    f"keys: {', '.join(MODEL_ENTRY_KEYS)} and the engine arguments "
                    f"{', '.join(ENGINE_ARGS)}")
            if not _has_type(value, kind):
                raise RunConfigError(f"{source}: [[models]] {entry['name']!r} {key} must be "
                                     f"{_TYPE_WORDS[kind]}, got {value!r}")
    return tuple(dict(e) for e in entries)


def _check_value(source: str | None, section: str, key: str, value: Any) -> None:
    schema = SCHEMA[section]
    if key not in schema:
        raise RunConfigError(f"{source}: unknown key {key!r} in [{section}]; valid keys: "
                             f"{', '.join(schema)}")
    expected = schema[key][1]
    if value is None or _has_type(value, expected):
        return
    words = " or ".join(_TYPE_WORDS[t] for t in (expected if isinstance(expected, tuple)
                                                  else (expected,)))
    raise RunConfigError(f"{source}: [{section}] {key} must be {words}, got "
                         f"{type(value).__name__} {value!r}")


def _has_type(value: Any, expected: type | tuple[type, ...]) -> bool:
    if isinstance(expected, tuple):  # several accepted types, e.g. a key or a list of keys
        return any(_has_type(value, t) for t in expected)
    if expected is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok and math.isfinite(value)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected == INT_LIST:
        return isinstance(value, list) and all(_has_type(v, int) for v in value)
    return isinstance(value, expected)


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               list: "an array", INT_LIST: "an array of integers"}
