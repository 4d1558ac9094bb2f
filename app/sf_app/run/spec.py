"""The resolved run specification: one file, written once, that every process reads its
own section of.

A run's values come from the command line, the environment's shared variables
(``SF_<KEY>``, ``seamlessflow.runfile.RunShared``) and the run file's ``[run]`` table,
in that order (:func:`run_values`); ``RunConfig`` fills what none of them gives, the
task's and the pretrained model's defaults among it (``max_tokens``), in one place.
:func:`resolved_sections` then copies the shared section into every settings class's
section, into each field that :func:`seamlessflow.runfile.shared` marks, beside what the
run file set for that class; :func:`write_resolved` writes the result. The embedded run
writes it into its run directory (``run.toml``), ``seamlessflow resolve`` wherever it is
told (compose: the run volume), and every process reads it as its run file
(``SF_CONFIG``): a value given once reaches every process that uses it, whichever way the
run was started. Environment variables still win over the file, one name each
(``seamlessflow.runfile.variable``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomli_w
from pydantic_settings import BaseSettings

from seamlessflow.runfile import (
    RUN_SECTION,
    RunShared,
    load,
    section_of,
    shared_fields,
    shared_variable,
)
from sf_app.run.config import RunConfig

RESOLVED_HEADER = (
    "# The resolved run specification (seamlessflow resolve / seamlessflow up): [run] is\n"
    "# the run's shared section, copied into every section that uses it; each process\n"
    "# reads its own section (SF_CONFIG names this file). Environment variables win.\n"
)


def shared_from_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The shared values set in the environment (``SF_STEPS=...``), by key; a list key
    (``policies``) split at commas."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for key in RunShared.model_fields:
        text = environ.get(shared_variable(key))
        if text is None or text == "":
            continue
        values[key] = (
            [p.strip() for p in text.split(",") if p.strip()] if key == "policies" else text
        )
    return values


def run_values(
    run_table: Mapping[str, Any],
    command_line: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """``RunConfig``'s input: the run file's ``[run]`` table, then the shared variables
    of the environment, then the command line (highest)."""
    return {**run_table, **shared_from_environment(environ), **command_line}


def shared_values(config: RunConfig) -> dict[str, Any]:
    """The resolved shared section of a run (``policies`` as a list)."""
    return {key: getattr(config, key) for key in RunShared.model_fields}


def resolved_sections(
    config: RunConfig,
    settings_classes: Iterable[type[BaseSettings]],
    run_sets: Mapping[str, Mapping[str, Any]] | None = None,
    run_defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every section of the resolved file: ``[run]`` (the shared section) and, for each
    settings class, in rising precedence: ``run_defaults`` (what a run keeps unless its
    file says otherwise), what the run file set for it (``config.run_file``'s section),
    ``run_sets`` (what the run itself decides: its run id, directory, model), and each of
    its shared fields copied from ``[run]``."""
    user = load(config.run_file) if config.run_file is not None else {}
    run = shared_values(config)
    sections: dict[str, dict[str, Any]] = {RUN_SECTION: run}
    for cls in settings_classes:
        section = section_of(str(cls.model_config.get("env_prefix", "")))
        table: dict[str, Any] = {
            **(run_defaults or {}).get(section, {}),
            **user.get(section, {}),
            **(run_sets or {}).get(section, {}),
        }
        for field, key in shared_fields(cls).items():
            value = run[key]
            table[field] = ",".join(value) if isinstance(value, list) else value
        if table:
            sections[section] = table
    return sections


def write_resolved(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write the resolved specification (TOML) at ``path``; the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(RESOLVED_HEADER + tomli_w.dumps({k: dict(v) for k, v in sections.items()}))
    return path
