"""A registry of named plug-ins, chosen by a setting (a loss, an advantage estimator).

Plug-ins register themselves by name when their module is imported; a setting names
one. An unknown name is a configuration error that lists every known name.
"""

from __future__ import annotations

from typing import Generic, TypeVar

Plugin = TypeVar("Plugin")


class Registry(Generic[Plugin]):
    """Plug-ins of one kind, by name; ``setting`` is the variable that chooses one."""

    def __init__(self, kind: str, setting: str) -> None:
        self.kind = kind
        self.setting = setting
        self._plugins: dict[str, Plugin] = {}

    def add(self, name: str, plugin: Plugin) -> None:
        # two plug-ins under one name would make the setting ambiguous
        if name in self._plugins:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._plugins[name] = plugin

    def get(self, name: str) -> Plugin:
        try:
            return self._plugins[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r} ({self.setting}); known: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._plugins)
