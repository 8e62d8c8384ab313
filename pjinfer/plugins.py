"""Plugins, as vLLM has them: Python entry points in the group `pjinfer.plugins`.

A plugin is a callable that takes no arguments, run once per process at start-up. It registers
what it adds through the public registries: a model architecture
(`pjinfer.models.registry.register_model`), a scheduling policy
(`pjinfer.engine.scheduling_policy.register_scheduling_policy`) or a Prometheus collector for
the server's /metrics (`pjinfer.plugins.register_metrics_collector`). Plugins load before the
EngineConfig is built, since the config checks `scheduling_policy` against the registry.

`--plugins a,b` (`LLM(plugins=[...])`) loads only those; by default every installed plugin
loads, unless a selection was already loaded in this process (so a benchmark's `--plugins`
is not widened by the `LLM` it builds).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from importlib.metadata import EntryPoint, entry_points
from typing import Any

log = logging.getLogger("pjinfer")
PLUGIN_GROUP = "pjinfer.plugins"

_loaded: set[str] = set()
_selected = False  # a --plugins selection was loaded: the default loads nothing more
_collectors: list[Any] = []


def installed_plugins() -> dict[str, EntryPoint]:
    """Name -> entry point of every installed plugin (read from sys.path each call)."""
    return {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}


def parse_plugin_names(text: str) -> list[str]:
    """`--plugins a,b` -> ["a", "b"]; an empty value selects none."""
    return [name.strip() for name in text.split(",") if name.strip()]


class PluginError(ValueError):
    """An unknown plugin name, or a plugin that failed; the message says which."""


def load_plugins(names: Sequence[str] | None = None) -> list[str]:
    """Run the named plugins (None: all installed), each once; returns the names run now.
    An unknown name is a PluginError that lists the installed plugins."""
    global _selected
    installed = installed_plugins()
    if names is None:
        if _selected:
            return []
        names = sorted(installed)
    else:
        _selected = True
        unknown = [n for n in names if n not in installed]
        if unknown:
            raise PluginError(f"--plugins: no installed plugin named {', '.join(unknown)}; "
                             f"installed: {', '.join(sorted(installed)) or 'none'} (entry "
                             f"points of group {PLUGIN_GROUP!r})")
    ran = []
    for name in names:
        if name not in _loaded:
            _run(name, installed[name])
            ran.append(name)
    return ran


def _run(name: str, entry_point: EntryPoint) -> None:
    try:
        plugin = entry_point.load()
        plugin()
    except Exception as e:
        raise PluginError(f"plugin {name!r} ({entry_point.value}) failed to load: "
                           f"{type(e).__name__}: {e}") from e
    _loaded.add(name)
    log.info("loaded plugin %s (%s)", name, entry_point.value)


def register_metrics_collector(collector: Any) -> None:
    """Add a prometheus_client Collector (an object with `collect()`) to every server's
    /metrics, including servers built before this call is made."""
    _collectors.append(collector)


def metrics_collectors() -> list[Any]:
    return list(_collectors)
