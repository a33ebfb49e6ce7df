"""A registry of swappable parts: a name -> the object that implements it, imported on first use.

Entries are ``"module:attribute"`` strings, so a registry costs no import until a part is asked for (the CLI
lists and validates names without importing torch or the parts' code). Attention backends, MoE backends and
tool-call parsers each have one.
"""

from __future__ import annotations

import importlib
from typing import Generic, Mapping, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Names of one kind of part, each mapped to ``"module:attribute"``.

    Args:
        flag: the option that picks a name (``--attention-backend``); error messages name it.
        entries: name -> ``"module:attribute"``, in the order the names are listed.
    """

    def __init__(self, flag: str, entries: Mapping[str, str]):
        for name, target in entries.items():
            if target.count(":") != 1:
                raise ValueError(f"registry {flag}: entry {name!r} must be 'module:attribute', got {target!r}")
        self.flag = flag
        self._entries = dict(entries)
        self._loaded: dict[str, T] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def check(self, name: str, *, extra: tuple[str, ...] = ()) -> str:
        """``name`` when it is registered (or one of ``extra``, e.g. ``auto``), else ValueError naming the flag and
        the valid names."""
        if name in self._entries or name in extra:
            return name
        raise ValueError(f"{self.flag} must be one of {', '.join((*extra, *self._entries))}, got {name!r}")

    def get(self, name: str) -> T:
        """The object registered as ``name``, imported on first use. Raises ValueError for an unknown name."""
        if name not in self._loaded:
            module, attribute = self._entries[self.check(name)].split(":")
            self._loaded[name] = getattr(importlib.import_module(module), attribute)
        return self._loaded[name]
