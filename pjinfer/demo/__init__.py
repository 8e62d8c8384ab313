"""The embedded demo model: a tiny Llama that has memorised the Zen of Python.

It ships as package data so that `pjinfer` can be served, tested and benchmarked end to end with
no download. `python -m pjinfer.demo.train` rebuilds it. This module stays import-light (no torch,
no transformers) because the engine imports it only to find the folder.
"""

import ast
import codecs
import functools
import importlib.util
from pathlib import Path

DEMO_MODEL_DIR: Path = Path(__file__).resolve().parent
DEMO_MODEL_NAME = "pjinfer-demo"


@functools.cache
def zen_of_python() -> str:
    """The text `import this` prints, without printing it.

    Importing `this` writes to stdout as a side effect, so the rot13 string `s` is read from the
    module's source instead.
    """
    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise RuntimeError("the standard-library module `this` is missing from this Python")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "s":
            return codecs.decode(node.value.value, "rot13")
    raise RuntimeError(f"no string `s` found in {spec.origin}")


def zen_lines() -> list[str]:
    """The title line followed by the 19 aphorisms, blank lines dropped."""
    return [line for line in zen_of_python().splitlines() if line]
