"""A versioned model repository on local disk: `REPO/<name>/<version>/` folders.

Each version folder is what the engine loads (a Hugging Face folder, a `pjinfer convert` orbax
checkpoint, or a GGUF file's folder). A model reference is `name` (the newest version) or
`name@version`. Versions that are all digits sort as numbers (`10` after `9`), others as text,
numbers before text, so `model@latest`-style tags never shadow a numbered release.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pjinfer.errors import ModelLoadError


class ModelNotInRepository(ModelLoadError):
    """The reference names no model, or no version of it, in the repository (HTTP 404)."""


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A parsed `name` or `name@version`."""

    name: str
    version: str | None = None

    @classmethod
    def parse(cls, text: str) -> ModelRef:
        name, sep, version = text.partition("@")
        if not name or (sep and not version):
            raise ValueError(f"model reference {text!r} must be 'name' or 'name@version'")
        return cls(name, version or None)

    def __str__(self) -> str:
        return self.name if self.version is None else f"{self.name}@{self.version}"


def _version_key(version: str) -> tuple[int, int, str]:
    return (0, int(version), "") if version.isdigit() else (1, 0, version)


class ModelRepository:
    """Resolves references to version folders; reads the disk on every call, so a version
    copied in while the server runs is found by the next load or replace."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_dir():
            raise ValueError(f"model repository {str(self.root)!r} is not a folder; lay it "
                             "out as REPO/<name>/<version>/")

    def names(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir() if p.is_dir())

    def versions(self, name: str) -> list[str]:
        """Versions of `name`, oldest first."""
        folder = self._folder(name)
        return sorted((p.name for p in folder.iterdir() if p.is_dir()), key=_version_key)

    def resolve(self, ref: ModelRef | str) -> tuple[str, Path]:
        """(version, folder) of a reference; the newest version when it names none."""
        ref = ModelRef.parse(ref) if isinstance(ref, str) else ref
        versions = self.versions(ref.name)
        if not versions:
            raise ModelNotInRepository(f"model {ref.name!r} has no version folder under "
                                       f"{self.root / ref.name}")
        version = ref.version or versions[-1]
        if version not in versions:
            raise ModelNotInRepository(f"model {ref.name!r} has no version {version!r} in "
                                       f"{self.root}; versions: {', '.join(versions)}")
        return version, self.root / ref.name / version

    def _folder(self, name: str) -> Path:
        if "/" in name or name in ("", ".", ".."):
            raise ModelNotInRepository(f"model name {name!r} is not a plain folder name")
        folder = self.root / name
        if not folder.is_dir():
            raise ModelNotInRepository(f"model {name!r} is not in the repository {self.root}; "
                                       f"models: {', '.join(self.names()) or '(none)'}")
        return folder
