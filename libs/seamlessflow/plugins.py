"""Named plug-ins and dotted paths: one registry class for every kind.

Rewards, agents, tasks, tool parsers, engine backends, losses and advantage estimators
each have one ``Registry``. Plug-ins register themselves by name when their module is
imported (``@REGISTRY.register("name")``); a setting names one. An unknown name is a
configuration error (``UnknownPlugin``) that lists every known name. Where a user's own
function may stand instead (rewards, agents), ``import_dotted`` loads it by its path.

A setting that names plug-ins says which registry (``ChosenFrom``), and the
configuration reference (``seamlessflow config``, docs/configuration.md) lists what is
registered there, each plug-in with its summary (``summary_of``) and its own keys
(``keys_of``): the registry is the only list of them.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

Plugin = TypeVar("Plugin")


class UnknownPlugin(ValueError):
    """A setting names a plug-in nobody registered (the message lists the known ones)."""


class Registry(Generic[Plugin]):
    """Plug-ins of one kind, by name; ``setting`` is what chooses one (named in errors).

    ``dotted_paths``: a name that is not registered may be ``package.module:function``,
    imported on lookup. ``builtins``: modules imported before the first lookup, whose
    import registers the built-in plug-ins (so listing or finding one needs no import
    by the caller, and importing the registry itself stays cheap). ``hint``: what else a
    setting may name, appended to the unknown-name error."""

    def __init__(
        self,
        kind: str,
        setting: str,
        *,
        dotted_paths: bool = False,
        builtins: tuple[str, ...] = (),
        hint: str = "",
    ) -> None:
        self.kind = kind
        self.setting = setting
        self.dotted_paths = dotted_paths
        self.hint = hint
        self._builtins = builtins
        self._plugins: dict[str, Plugin] = {}

    def add(self, name: str, plugin: Plugin) -> None:
        # two plug-ins under one name would make the setting ambiguous (the same one
        # twice is a module imported again, harmless)
        if name in self._plugins and self._plugins[name] is not plugin:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._plugins[name] = plugin

    def register(self, name: str) -> Callable[[Plugin], Plugin]:
        """Decorator: register the decorated function or class as ``name``."""

        def decorate(plugin: Plugin) -> Plugin:
            self.add(name, plugin)
            return plugin

        return decorate

    def find(self, name: str) -> Plugin | None:
        """The plug-in registered as ``name``, or None."""
        self._load_builtins()
        return self._plugins.get(name)

    def get(self, name: str) -> Plugin:
        """The plug-in registered as ``name`` (or at that dotted path, where allowed)."""
        found = self.find(name)
        if found is not None:
            return found
        if self.dotted_paths:
            function = import_dotted(name)
            if function is not None:
                return function  # type: ignore[return-value]  # the caller's contract
        raise UnknownPlugin(self.unknown_message(name))

    def unknown_message(self, name: str) -> str:
        message = f"unknown {self.kind} {name!r} ({self.setting}); known: {', '.join(self.names())}"
        if self.dotted_paths:
            message += "; or a dotted path 'package.module:function'"
        if self.hint:
            message += f"; {self.hint}"
        return message

    def names(self) -> list[str]:
        self._load_builtins()
        return sorted(self._plugins)

    def _load_builtins(self) -> None:
        if self._builtins:
            modules, self._builtins = self._builtins, ()
            for module in modules:
                importlib.import_module(module)


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


@dataclass(frozen=True)
class ChosenFrom:
    """Marks a setting whose value names plug-ins of one registry:
    ``backend: Annotated[str, ChosenFrom("sf_engine.backends.registry:ENGINE_BACKENDS")]``.
    The configuration reference lists what is registered there under the setting. The
    registry is named by its path and imported only then: a plug-in's module may import
    torch, and a settings module stays cheap to import."""

    registry: str
    """``package.module:NAME`` of the ``Registry``."""

    def load(self) -> Registry[Any]:
        module_name, _, attr = self.registry.partition(":")
        found = getattr(importlib.import_module(module_name), attr)
        if not isinstance(found, Registry):
            raise TypeError(f"{self.registry} is not a Registry")
        return found


def summary_of(plugin: Any) -> str:
    """What a plug-in does: its ``summary`` where it has one (a plug-in assembled from
    parts, such as a loss), else the first paragraph of its docstring, on one line."""
    summary = getattr(plugin, "summary", None)
    if isinstance(summary, str):
        return summary
    return first_paragraph(inspect.getdoc(plugin))


def first_paragraph(docstring: str | None) -> str:
    """A docstring's first paragraph on one line ("" for none)."""
    paragraph = inspect.cleandoc(docstring or "").split("\n\n", 1)[0]
    return " ".join(paragraph.split())


@dataclass(frozen=True)
class PluginKey:
    """One key of a plug-in's own settings (a ``plugin_settings.PluginSettings`` field)."""

    name: str
    default: Any
    meaning: str


def keys_of(plugin: Any) -> list[PluginKey]:
    """The keys of a plug-in's own settings (its ``settings_class``), in their order;
    none for a plug-in without one."""
    settings_class = getattr(plugin, "settings_class", None)
    fields = getattr(settings_class, "model_fields", {})
    return [
        PluginKey(name, field.get_default(call_default_factory=True), field.description or "")
        for name, field in fields.items()
    ]
