"""The plug-ins part of the configuration reference (``seamlessflow config``).

A setting that names plug-ins carries ``ChosenFrom(<registry>)``
(``seamlessflow.plugins``). Its row in docs/configuration.md gets the names registered
there, and the reference ends with one table per such setting: each plug-in with what
it does (``summary_of``) and its own keys with their defaults (``keys_of``). The
registries are the only lists of the built-in plug-ins; no docstring repeats them.
Registries are imported here, and a plug-in's module may import torch: only the
``config`` command does.
"""

from __future__ import annotations

from pydantic.fields import FieldInfo

from seamlessflow.plugins import ChosenFrom, keys_of, summary_of

SECTION = "Plug-ins"


def chosen_from(info: FieldInfo) -> ChosenFrom | None:
    """The registry a setting names plug-ins of, if it does."""
    return next((item for item in info.metadata if isinstance(item, ChosenFrom)), None)


def registered_names(marker: ChosenFrom) -> str:
    """The sentence added to the setting's meaning: what is registered."""
    names = ", ".join(f"`{name}`" for name in marker.load().names())
    return f"Registered: {names} (each in [{SECTION}](#plug-ins) below)."


def plugins_section(chosen: list[tuple[str, ChosenFrom]]) -> list[str]:
    """The reference's last settings section: for each ``(variable, marker)``, a table of
    the plug-ins registered for that variable."""
    if not chosen:
        return []
    lines = [
        "",
        f"## {SECTION}",
        "",
        "What each setting that names a plug-in may name, from the plug-in registries",
        "(`seamlessflow.plugins`): what each does (from its docstring) and its own keys,",
        "set as the setting's documentation above says.",
    ]
    for variable, marker in chosen:
        registry = marker.load()
        lines += ["", f"### `{variable}` ({registry.kind})", "",
                  "| name | what it does | its keys (default) |", "|---|---|---|"]  # fmt: skip
        for name in registry.names():
            plugin = registry.find(name)
            keys = " ".join(
                f"`{key.name}` ({key.default!s}): {' '.join(key.meaning.split())}"
                for key in keys_of(plugin)
            )
            lines.append(f"| `{name}` | {_cell(summary_of(plugin))} | {_cell(keys) or 'none'} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
