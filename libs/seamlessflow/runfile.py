"""The run file: one TOML file that describes a run and every service's settings.

    [run]            # the run as a whole: seamlessflow up's options (--steps ...)
    steps = 300
    mode = "multiplexed"

    [trainer]        # one section per settings class: its fields, without the prefix
    loss = "dr_grpo"  # = SF_TRAINER_LOSS

``seamlessflow up --config run.toml`` reads all of it (options given on the command line
win) and copies it into the run directory. A process started alone reads the same file
when ``SF_CONFIG`` names it: its settings class takes its own section and the ``[run]``
keys that set one of its fields (``RUN_KEYS``), so compose and the embedded run can
share one description. Precedence, highest first: arguments in code, environment
variables, the run file, defaults.

A section is named after its settings class's variable prefix (``SF_TRAINER_`` ->
``trainer``, ``SF_TAG_SCHEDULER_`` -> ``tag_scheduler``, ``-`` works too; the prefix
``SF_`` itself -> ``mesh``). A key no class knows is an error naming the closest valid
one; so is a service key that ``[run]`` owns (set twice, one would silently win).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pydantic import AliasChoices, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

RUN_FILE_VARIABLE = "SF_CONFIG"
"""The environment variable naming a process's run file."""

RUN_SECTION = "run"


@dataclass(frozen=True)
class RunOption:
    """A ``[run]`` key (and ``seamlessflow up`` option) that is a service setting."""

    variables: tuple[str, ...]
    """The service variables it sets (one field of one settings class each)."""
    default: Any
    """Its one default: every settings field it sets and ``RunConfig`` use it
    (``run_default``); ``tests/mesh/test_run_file.py`` checks that none declares another."""
    service_default_differs: str = ""
    """Why a service's field keeps another default, if one must (the reason)."""


RUN_OPTIONS: dict[str, RunOption] = {
    "seed": RunOption(("SF_SEED",), 0),
    "policies": RunOption(
        ("SF_POLICIES",),
        "policy",
        service_default_differs="empty in a process means that process's own SF_POLICY",
    ),
    "mode": RunOption(("SF_TAG_SCHEDULER_MODE",), "auto"),
    "task": RunOption(("SF_TRAJECTORY_TASK", "SF_TRAINER_EVAL_TASK"), "arithmetic"),
    "group_size": RunOption(("SF_TRAJECTORY_GROUP_SIZE",), 8),
    "groups_per_batch": RunOption(("SF_TRAJECTORY_GROUPS_PER_BATCH",), 8),
    "max_batches_ahead": RunOption(("SF_TRAJECTORY_MAX_BATCHES_AHEAD",), 1),
    "group_timeout_s": RunOption(("SF_TRAJECTORY_GROUP_TIMEOUT_S",), 300.0),
    "steps": RunOption(("SF_TRAINER_STEPS",), 300),
    "checkpoint_every": RunOption(("SF_TRAINER_CHECKPOINT_EVERY",), 10),
    "lr": RunOption(("SF_TRAINER_LR",), 1e-4),
    "eval_every": RunOption(("SF_TRAINER_EVAL_EVERY",), 0),
    "precision": RunOption(("SF_TRAINER_PRECISION",), "auto"),
    "max_tokens": RunOption(("SF_TRAINER_EVAL_MAX_TOKENS", "SF_AGENTS_MAX_TOKENS"), 6),
    "engine_batch_size": RunOption(("SF_ENGINE_MAX_BATCH_SIZE",), 64),
    "agent": RunOption(("SF_AGENTS_AGENT",), "single_turn"),
    "agent_concurrency": RunOption(("SF_AGENTS_CONCURRENCY",), 64),
    "env_step_latency_ms": RunOption(("SF_ENV_STEP_LATENCY_MS",), 0.0),
    "env_latency_sigma": RunOption(("SF_ENV_STEP_LATENCY_SIGMA",), 0.5),
}
"""``[run]`` keys that are service settings, declared once: each sets these variables'
fields, and has one default. The embedded run passes them to its processes as these
variables; a process reading the file alone takes them from ``[run]``. The other
``[run]`` keys (``engines``, ``runs_dir``, ``report_to`` ...) concern only the embedded
run (``sf_app.run.config.RunConfig``)."""

RUN_KEYS: dict[str, tuple[str, ...]] = {key: opt.variables for key, opt in RUN_OPTIONS.items()}
"""Each ``[run]`` key of ``RUN_OPTIONS`` and the variables it sets."""


def run_default(key: str) -> Any:
    """The one default of the run option ``key``, for a settings field it sets."""
    return RUN_OPTIONS[key].default


class RunFileError(ValueError):
    """The run file cannot be read or names something unknown (one line says which)."""


def section_of(env_prefix: str) -> str:
    """The run-file section of a settings class with this variable prefix."""
    name = env_prefix.removeprefix("SF_").rstrip("_").lower()
    return name or "mesh"


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The file's sections (names normalised: ``-`` -> ``_``), each a table."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise RunFileError(f"run file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise RunFileError(f"run file {path} is not valid TOML: {exc}") from None
    sections: dict[str, dict[str, Any]] = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise RunFileError(
                f"run file {path}: {name!r} is outside any section; put it under [run] or "
                "under its service's section"
            )
        sections[name.replace("-", "_")] = table
    return sections


def nearest(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or nothing."""
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def owned_by_run(env_prefix: str, field: str) -> str | None:
    """The ``[run]`` key that sets ``field`` of the class with ``env_prefix``, if any."""
    variable = (env_prefix + field).upper()
    for key, variables in RUN_KEYS.items():
        if variable in variables:
            return key
    return None


def check_section(
    path: Path, section: str, table: dict[str, Any], env_prefix: str, fields: Iterable[str]
) -> None:
    """Every key of a service section is a field of its class, and not one ``[run]`` owns."""
    known = set(fields)
    for key in table:
        if key not in known:
            raise RunFileError(f"run file {path}: unknown key {section}.{key}{nearest(key, known)}")
        run_key = owned_by_run(env_prefix, key)
        if run_key is not None:
            raise RunFileError(
                f"run file {path}: {section}.{key} is a run setting: set it as [run] {run_key}"
            )


def values_for(env_prefix: str, fields: Iterable[str], path: Path) -> dict[str, Any]:
    """What the run file at ``path`` sets for a settings class: its section's keys and
    the ``[run]`` keys that set one of its fields (checked as :func:`check_section`)."""
    known = set(fields)
    sections = load(path)
    section = section_of(env_prefix)
    table = sections.get(section, {})
    check_section(path, section, table, env_prefix, known)
    values = dict(table)
    for key, value in sections.get(RUN_SECTION, {}).items():
        for variable in RUN_KEYS.get(key, ()):
            if not variable.startswith(env_prefix):
                continue
            field = variable.removeprefix(env_prefix).lower()
            if field in known:
                # a list in [run] (policies) is a comma-separated variable to a service
                values[field] = ",".join(map(str, value)) if isinstance(value, list) else value
    return values


def run_file_from_environment() -> Path | None:
    """The run file ``SF_CONFIG`` names (None: unset or empty)."""
    value = os.environ.get(RUN_FILE_VARIABLE, "")
    return Path(value) if value else None


def _input_key(field: FieldInfo, name: str) -> str:
    """The key a settings class accepts for ``name``: its first alias if it has any."""
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        first = alias.choices[0]
        return first if isinstance(first, str) else name
    return alias if isinstance(alias, str) else name


class RunFileSource(PydanticBaseSettingsSource):
    """A settings source: what the run file ``SF_CONFIG`` names sets for this class."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # the whole file is read at once in __call__

    def __call__(self) -> dict[str, Any]:
        path = run_file_from_environment()
        if path is None:
            return {}
        fields = self.settings_cls.model_fields
        prefix = str(self.settings_cls.model_config.get("env_prefix", ""))
        retired: Mapping[str, str] = getattr(self.settings_cls, "retired", {})
        for key in load(path).get(section_of(prefix), {}):
            if key in retired:
                raise RunFileError(f"run file {path}: {retired[key]}")
        values = values_for(prefix, fields, path)
        return {_input_key(fields[name], name): value for name, value in values.items()}


class RunFileSettings(BaseSettings):
    """Settings read from the environment, then from the run file (``SF_CONFIG``), then
    their defaults. Every settings class of the mesh derives from it."""

    retired: ClassVar[Mapping[str, str]] = {}
    """Fields no longer read -> the one line naming their new spelling. Set in the
    environment or in the class's run-file section, they stop the process with that
    line instead of being ignored without a word."""

    @model_validator(mode="after")
    def _no_retired_variables(self) -> RunFileSettings:
        prefix = str(self.model_config.get("env_prefix", ""))
        for field, line in self.retired.items():
            if f"{prefix}{field.upper()}" in os.environ:
                raise ValueError(line)
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            dotenv_settings,
            RunFileSource(settings_cls),
            file_secret_settings,
        )
