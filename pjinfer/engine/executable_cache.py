"""Compiled step executables on disk, so a warm restart neither traces nor lowers the model.

JAX's persistent compilation cache skips only the XLA compile: every bucket shape is still traced
and lowered (tens of seconds for a large unrolled model). This cache stores the finished
executable (`jax.experimental.serialize_executable`) under a key computed without tracing:
jax/jaxlib versions, backend and devices, the static options, every argument leaf's shape, dtype
and sharding, the pytree structures, and a hash of pjinfer's own source code. Anything that could
change the program changes the key; a stale, corrupt or incompatible entry is recompiled.

Entries are pickles: load only a directory you trust (as with JAX's own cache).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import pickle
import sys
import tempfile
import threading
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from pjinfer.kernels.fp8_matmul import step_compiler_options

log = logging.getLogger("pjinfer")

SUBDIR = "pjinfer-executables"
FORMAT = 1  # bump when the entry layout changes


class ExecutableCache:
    """A folder of serialized `jax.stages.Compiled`, one file per key; never raises on I/O."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    @classmethod
    def under(cls, compilation_cache_dir: str | None) -> ExecutableCache | None:
        """The cache beside JAX's compilation cache (`<dir>/pjinfer-executables`), or None.

        None under multi-process JAX too: an executable there spans other hosts' devices.
        """
        if not compilation_cache_dir or jax.process_count() > 1:
            return None
        return cls(Path(compilation_cache_dir) / SUBDIR)

    def path(self, name: str, key: str) -> Path:
        """The entry's file: the name, then the sha256 of the key text."""
        return self.directory / f"{name}-{hashlib.sha256(key.encode()).hexdigest()}.jaxexec"

    def load(self, name: str, static: object, args: tuple) -> jax.stages.Compiled | None:
        """The executable stored for `name` under these static options and argument types, or
        None: a miss, or an entry that cannot be used (logged; the caller recompiles)."""
        text = describe(name, static, args)
        path = self.path(name, text)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:  # unreadable or truncated: recompile and overwrite
            log.warning("executable cache: cannot read %s (%s); recompiling", path.name, e)
            return None
        try:
            if entry["format"] != FORMAT or entry["key"] != text:
                raise ValueError("key mismatch")
            in_tree = jax.tree.structure((args, {}))
            if entry["in_tree"] != in_tree:
                raise ValueError("argument structure mismatch")
            # exactly the compile's devices, in its order: a wrong list aborts the process
            by_id = {d.id: d for d in jax.devices()}
            devices = [by_id[i] for i in entry["devices"]]
            from jax.experimental.serialize_executable import deserialize_and_load

            return deserialize_and_load(entry["executable"], in_tree, entry["out_tree"],
                                        execution_devices=devices)
        except Exception as e:
            log.warning("executable cache: cannot load %s (%s); recompiling", path.name, e)
            return None

    def store(self, name: str, static: object, args: tuple,
              compiled: jax.stages.Compiled) -> bool:
        """Write the entry atomically (temp file + rename); False (logged) when it cannot."""
        text = describe(name, static, args)
        path = self.path(name, text)
        try:
            from jax.experimental.serialize_executable import serialize

            blob, in_tree, out_tree = serialize(compiled)
            devices = [d.id for d in compiled.runtime_executable().local_devices()]
            data = pickle.dumps(dict(format=FORMAT, key=text, executable=blob, in_tree=in_tree,
                                     out_tree=out_tree, devices=devices),
                                protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:  # e.g. an executable with constants JAX cannot serialize
            log.warning("executable cache: cannot serialize %s (%s)", name, e)
            return False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{path.name}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("executable cache: cannot write %s (%s)", path, e)
            return False
        return True


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_hits = threading.local()


def _count_hit(event: str, **_) -> None:
    if event == _JAX_CACHE_HIT:  # recorded in the compiling thread
        _hits.count = getattr(_hits, "count", 0) + 1


@contextlib.contextmanager
def served_by_jax_cache():
    """Yields a callable: did a compile inside the block come from JAX's persistent cache?

    Such an executable runs, but on XLA:CPU its re-serialization lacks the compiled kernels
    ("Function ... not found" on every step after the next restart): the caller must not
    store it. This happens when a new pjinfer changes every key here while JAX's cache
    still holds the steps; those then restart through JAX's cache (no XLA compile)."""
    _register_listener()
    before = getattr(_hits, "count", 0)
    yield lambda: getattr(_hits, "count", 0) > before


def compile_step(jitted, args: tuple) -> tuple[Any, bool]:
    """Lower and compile `jitted(*args)` (a step over params `args[0]`) with the XLA options
    its kernels ask for (`fp8_matmul.step_compiler_options`); whether JAX's persistent cache
    served it (`served_by_jax_cache`). The options follow from the params' dtypes, which every
    key here already holds."""
    with served_by_jax_cache() as served:
        fn = jitted.lower(*args).compile(step_compiler_options(args[0]) or None)
    return fn, served()


@functools.cache
def _register_listener() -> None:
    from jax._src import monitoring  # JAX's own event hooks: no public equivalent

    monitoring.register_event_listener(_count_hit)


def describe(name: str, static: object, args: tuple) -> str:
    """Everything the compiled program of `name(*args)` under `static` depends on, as text."""
    leaves, tree = jax.tree.flatten(args)
    lines = [f"format {FORMAT}", f"name {name}", *_environment(),
             f"static {_stable_repr(static)}", f"tree {tree}"]
    lines += [_leaf(x) for x in leaves]
    return "\n".join(lines)


def _leaf(x) -> str:
    spec = f"{tuple(getattr(x, 'shape', ()))} {getattr(x, 'dtype', type(x).__name__)}"
    if getattr(x, "weak_type", False):
        spec += " weak"
    if isinstance(x, jax.Array):
        sharding = x.sharding
        mesh = getattr(sharding, "mesh", None)
        ids = sorted(d.id for d in sharding.device_set)
        spec += f" {sharding!r} devices={ids}"
        if isinstance(mesh, Mesh):
            spec += f" mesh={mesh.device_ids.tolist()}"
    return spec


def _stable_repr(obj) -> str:
    """repr, with dataclasses field by field and meshes with their device ids."""
    if isinstance(obj, Mesh):
        return (f"Mesh(names={obj.axis_names}, ids={obj.device_ids.tolist()}, "
                f"types={getattr(obj, 'axis_types', None)})")
    if is_dataclass(obj) and not isinstance(obj, type):
        inner = ", ".join(f"{f.name}={_stable_repr(getattr(obj, f.name))}" for f in fields(obj))
        return f"{type(obj).__qualname__}({inner})"
    if isinstance(obj, tuple | list):
        return f"{type(obj).__name__}({', '.join(map(_stable_repr, obj))})"
    return repr(obj)


def _environment() -> list[str]:
    import jaxlib

    device = jax.devices()[0]
    return [
        f"python {sys.version_info[:2]}", f"jax {jax.__version__}",
        f"jaxlib {jaxlib.__version__}",
        f"backend {jax.default_backend()} {device.client.platform_version}",
        f"devices {device.device_kind} x{jax.device_count()} "
        f"processes={jax.process_count()}",
        f"xla_flags {os.environ.get('XLA_FLAGS', '')}",
        f"x64 {jax.config.jax_enable_x64} "
        f"matmul_precision {jax.config.jax_default_matmul_precision}",
        f"pjinfer {source_digest()}",
    ]


@functools.cache
def source_digest() -> str:
    """sha256 of every .py file of the pjinfer package, mapped subpackages included."""
    h = hashlib.sha256()
    for rel, path in _source_files():
        try:
            h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
        except OSError:  # e.g. an editor's dangling lock file: not code
            continue
    return h.hexdigest()


def _source_files() -> list[tuple[str, Path]]:
    """(name relative to its package root, path) of every source file, sorted by name.

    Subpackages may live outside `pjinfer/` (setuptools `package-dir`, editable installs map
    `pjinfer.kernels` to `kernels/`): their folders are found through the import system.
    """
    import pjinfer

    roots: dict[Path, str] = {Path(p).resolve(): "pjinfer" for p in pjinfer.__path__}
    for parent in {root.parent for root in roots}:
        for child in sorted(parent.iterdir()):
            if child.name.isidentifier() and (child / "__init__.py").is_file():
                _add_package(roots, f"pjinfer.{child.name}")
    for name in sorted(sys.modules.copy()):  # mapped from anywhere else, when imported
        if name.startswith("pjinfer.") and name.count(".") == 1:
            _add_package(roots, name)
    files = {}
    for root, pkg in roots.items():
        for path in root.rglob("*.py"):
            files[f"{pkg}/{path.relative_to(root).as_posix()}"] = path
    return sorted(files.items())


def _add_package(roots: dict[Path, str], name: str) -> None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return
    for location in (spec and spec.submodule_search_locations) or ():
        path = Path(location).resolve()
        if not any(path.is_relative_to(r) for r in roots):
            roots[path] = name
