"""``seamlessflow up --config run.toml``: the whole run file checked before anything starts.

The library's ``seamlessflow.runfile`` gives each process its own part of the file; here
the embedded run checks all of it at once (every section known, every key a field,
every value of its field's type), so that a typo stops the run with one line naming the
key and its nearest valid name, instead of one process failing minutes later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic_settings import BaseSettings

from seamlessflow.runfile import RUN_SECTION, RunFileError, check_section, load, nearest, section_of
from sf_app.run.config import RunConfig


def settings_sections(settings_classes: list[type[BaseSettings]]) -> dict[str, type[BaseSettings]]:
    """Run-file section -> the settings class that reads it."""
    return {section_of(cls.model_config.get("env_prefix", "")): cls for cls in settings_classes}


def check_values(path: Path, section: str, table: dict[str, Any], model: type[BaseModel]) -> None:
    """Each value has its field's type (as the field would validate it)."""
    for key, value in table.items():
        annotation = model.model_fields[key].annotation
        try:
            TypeAdapter(annotation if annotation is not None else Any).validate_python(value)
        except ValidationError as exc:
            problem = exc.errors()[0]["msg"]
            raise RunFileError(f"run file {path}: {section}.{key} = {value!r}: {problem}") from None


def read_run_file(path: Path, settings_classes: list[type[BaseSettings]]) -> dict[str, Any]:
    """The ``[run]`` table of the file at ``path``, after checking every section."""
    sections = load(path)
    by_section = settings_sections(settings_classes)
    known = [RUN_SECTION, *by_section]
    for section, table in sections.items():
        if section == RUN_SECTION:
            fields = RunConfig.model_fields
            for key in table:
                if key not in fields:
                    raise RunFileError(
                        f"run file {path}: unknown key {section}.{key}{nearest(key, fields)}"
                    )
            continue
        cls = by_section.get(section)
        if cls is None:
            raise RunFileError(
                f"run file {path}: unknown section [{section}]{nearest(section, known)}"
            )
        check_section(path, section, table, cls, sections.get(RUN_SECTION, {}))
        check_values(path, section, table, cls)
    return dict(sections.get(RUN_SECTION, {}))
