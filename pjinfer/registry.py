"""A named registry open to users and plugins (model architectures, scheduling policies)."""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> entry; refuses to shadow an entry unless asked, and names the valid ones."""

    def __init__(self, kind: str, how_to_add: str, entries: dict[str, T]):
        self.kind = kind  # e.g. "architecture", for messages
        self.how_to_add = how_to_add
        self._entries = dict(entries)

    def register(self, name: str, entry: T, *, overwrite: bool = False) -> None:
        if name in self._entries and not overwrite:
            raise ValueError(f"{self.kind} {name!r} is already registered; "
                             "pass overwrite=True to replace it")
        self._entries[name] = entry

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: "
                             f"{', '.join(sorted(self._entries))} (or add one with "
                             f"{self.how_to_add})") from None
