"""Render a compose file as Compose would, without Compose: YAML anchors and ``<<`` merge
keys (PyYAML), variable interpolation, and profiles.

Interpolation follows the Compose specification: ``$$`` is a literal ``$``; ``$VAR`` and
``${VAR}`` are the variable (empty when unset); ``${VAR:-default}`` / ``${VAR-default}``
the default when the variable is unset or empty / unset; ``${VAR:?message}`` /
``${VAR?message}`` stop with the message; ``${VAR:+alt}`` / ``${VAR+alt}`` are ``alt``
when the variable is set (and non-empty). Values are interpolated, keys are not, and the
whole file is interpolated before profiles select services (as Compose does: a required
variable of a service outside the active profiles is still required).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


class MissingVariable(ValueError):
    """A ``${VAR:?message}`` whose variable is not set."""


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """``value`` with its variable references resolved against ``env``."""

    def resolve(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("name") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        if "${" in arg:
            raise ValueError(f"nested variable references are not supported: {value!r}")
        is_set = name in env
        has_value = bool(env.get(name))
        if op is None:
            return env.get(name, "")
        present = has_value if op.startswith(":") else is_set
        if op.endswith("-"):
            return env[name] if present else arg
        if op.endswith("+"):
            return arg if present else ""
        if not present:  # ? and :?
            raise MissingVariable(f"{name}: {arg or 'required variable is missing'}")
        return env[name]

    return VARIABLE.sub(resolve, value)


def _interpolate_values(node: Any, env: Mapping[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: _interpolate_values(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate_values(value, env) for value in node]
    return node


def render(path: Path, env: Mapping[str, str], profiles: Collection[str] = ()) -> dict[str, Any]:
    """The compose file at ``path`` as Compose sees it with the variables ``env`` and
    the active ``profiles``: only the services it would start. Raises
    ``MissingVariable`` for a required variable ``env`` lacks."""
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping")
    data = _interpolate_values(data, env)
    active = set(profiles)
    data["services"] = {
        name: service
        for name, service in data["services"].items()
        if not service.get("profiles") or active & set(service["profiles"])
    }
    for name, service in data["services"].items():
        missing = set(service.get("depends_on") or ()) - data["services"].keys()
        if missing:
            raise ValueError(f"{name} depends on services that do not start: {sorted(missing)}")
    return data


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    """A service's ``environment`` (mapping or list form) as strings."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(key): "" if value is None else str(value) for key, value in env.items()}


def restarts_after(policy: str, exit_code: int) -> bool:
    """Whether Compose starts a container with restart ``policy`` again after it exited
    with ``exit_code`` by itself."""
    name = policy.split(":")[0]
    if name in ("no", ""):
        return False
    if name == "on-failure":
        return exit_code != 0
    if name in ("always", "unless-stopped"):
        return True
    raise ValueError(f"unknown restart policy {policy!r}")
