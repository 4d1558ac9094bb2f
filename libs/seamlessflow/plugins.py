"""Named plug-ins (losses, advantage estimators, rewards, agents) and dotted paths.

Plug-ins register themselves by name when their module is imported; a setting names
one. An unknown name is a configuration error that lists every known name. Where a
user's own function may stand instead, ``import_dotted`` loads it by its path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

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


def import_dotted(path: str) -> Callable[..., Any] | None:
    """The callable at ``package.module:function`` (or ``package.module.function``);
    None when ``path`` has no module part. Raises ImportError / AttributeError for a
    path that does not exist, TypeError for one that is not callable."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        return None
    found = getattr(importlib.import_module(module_name), attr)
    if not callable(found):
        raise TypeError(f"{path!r} is not callable")
    return found
