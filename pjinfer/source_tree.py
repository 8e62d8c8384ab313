"""Running from a source checkout: keep its top-level `kernels/` from shadowing the Hub's.

The repository keeps pjinfer's kernels in `kernels/` (installed as `pjinfer.kernels`). Where the
checkout's root is on `sys.path` (`python -m ...` or pytest run from it), that directory is
also importable as a top-level `kernels`, the name of Hugging Face's kernel package, which
transformers >= 5.25 depends on and imports with its activations; it would get ours and fail.
A finder placed first on `sys.meta_path` looks the top-level name `kernels` up on `sys.path`
without the checkout's root. Installed copies (no `kernels/` beside `pjinfer/`) install none.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class HubKernelsFinder:
    """`import kernels` resolved past the checkout's root (nothing else is touched)."""

    @staticmethod
    def find_spec(name: str, path=None, target=None):
        if name != "kernels" or path is not None:
            return None
        entries = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
        return importlib.machinery.PathFinder.find_spec(name, entries)


def unshadow_hub_kernels() -> None:
    """Install `HubKernelsFinder` once, when pjinfer runs from a checkout."""
    if not os.path.isfile(os.path.join(_ROOT, "kernels", "__init__.py")):
        return
    if HubKernelsFinder not in sys.meta_path:
        sys.meta_path.insert(0, HubKernelsFinder)
