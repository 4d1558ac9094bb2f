"""The run file: one TOML file that describes a run and every service's settings.

    [run]            # the run as a whole: seamlessflow up's options (--steps ...)
    steps = 300
    mode = "multiplexed"

    [trainer]        # one section per settings class: its fields, without the prefix
    loss = "dr_grpo"  # = SF_TRAINER_LOSS

``seamlessflow up --config run.toml`` reads all of it (options given on the command line
win) and copies it into the run directory. A process started alone reads the same file
when ``SF_CONFIG`` names it: its settings class takes its own section and the ``[run]``
keys that are its shared fields (``RunShared``, ``shared``), so compose and the embedded
run can share one description. Precedence, highest first: arguments in code, environment
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
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

RUN_FILE_VARIABLE = "SF_CONFIG"
"""The environment variable naming a process's run file."""

RUN_SECTION = "run"


class RunShared(BaseModel):
    """The run's shared section: the values more than one process uses, each declared
    once here with its one default. A run file sets them under ``[run]``, the
    environment as ``SF_<KEY>`` (``SF_STEPS``), ``seamlessflow up`` as its options; the
    settings fields that use one say so with :func:`shared` (``steps: int =
    shared("steps")``), and read it under that one name only. The resolver of a run
    (``seamlessflow resolve``, ``seamlessflow up``) applies the task's and the model's
    defaults to it and writes it, with every section, into the run's resolved file."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    seed: int = 0
    """The run's seed, one for every service: the task order, torch in the trainer, and
    the trainer's evaluation split."""

    policies: str = ""
    """Every policy of the run, comma-separated (a list in a run file and for
    ``seamlessflow up``); empty in a process: its own ``SF_POLICY`` alone."""

    mode: Literal["auto", "colocated", "disaggregated", "multiplexed"] = "auto"
    """Deployment: which slots train, which roll out, which are lent, and when.
    ``auto`` (the default) lends the trainer's slot to rollout while the run measures
    more steps/s with lending than without, where its slots are real; ``multiplexed``
    lends it at every wait. ``colocated`` also defaults ``max_batches_ahead`` to 0
    (synchronous) in ``seamlessflow up``."""

    task: str = "arithmetic"
    """Task source (``seamlessflow.tasks``), a mixture of sources (``a*2+b``) or SRPO's
    stages (``a:100,a+b``: ``seamlessflow.tasks.schedule``); the held-out evaluation
    scores each source it names (unless a trainer has its own ``eval_task``)."""

    group_size: int = 8
    """Samples per task (GRPO group)."""

    groups_per_batch: int = 8
    """Tasks per optimizer step."""

    max_batches_ahead: int = 1
    """Rollout may run this many batches ahead of the trainer (0 = synchronous)."""

    group_timeout_s: float = 300.0
    """A group handed out to agents that makes no progress for this long is closed: its
    unfinished samples are dropped (e.g. sessions a restarted gateway lost)."""

    steps: int = 300
    """Trainer optimizer steps."""

    checkpoint_every: int = 10
    """The trainer also checkpoints every N steps (0 = only at the end): what a
    restarted trainer resumes from. The steps after it are lost to the policy (their
    batches stay trained once, see docs/design.md "Faults")."""

    lr: float = 1e-4
    """Trainer learning rate."""

    eval_every: int = Field(default=0, ge=0)
    """Held-out evaluation by the trainer every N steps, and of the base model before the
    first step and after the last (0: none): greedy answers to the task's eval split
    (``[trainer] eval_items`` of them), scored by its accuracy reward."""

    precision: Literal["auto", "fp32", "bf16-mixed"] = "auto"
    """The trainer's compute precision: ``auto`` is ``bf16-mixed`` where the trainer's
    device computes bf16 natively (a CUDA GPU that supports it, a CPU whose oneDNN
    reports bf16) and ``fp32`` elsewhere; the run prints its choice first and records it
    in summary.json. ``bf16-mixed`` keeps float32 master weights and optimizer state and
    computes forward and backward in bfloat16 (1.8x faster on a CPU with AVX512-BF16,
    ~40x slower on an AVX2-only one: docs/models.md)."""

    max_tokens: int = Field(default=6, ge=1)
    """Completion budget per agent call and per evaluated answer. Resolved once for the
    run when not given: the task's ``max_tokens`` if it has one (e.g. room for a tool
    call), else a pretrained model's run default, else 6."""

    engine_batch_size: int = 64
    """Requests one engine decodes together."""

    agent: str = "single_turn"
    """Agent run for each sample (registered name or dotted path)."""

    agent_concurrency: int = 64
    """Concurrent agent sessions."""

    env_step_latency_ms: float = Field(default=0.0, ge=0.0)
    """A built-in environment's time per step (the median of a log-normal; 0: none): a
    slow environment, as a real one that runs code or a browser is."""

    env_latency_sigma: float = Field(default=0.5, ge=0.0)
    """The spread of that log-normal (0: every step takes the median)."""


SHARED_KEY = "shared"
"""The mark :func:`shared` leaves in a field's JSON schema extras."""


def shared_variable(key: str) -> str:
    """The one environment variable of the shared value ``key``: ``SF_<KEY>``."""
    return f"SF_{key.upper()}"


def shared(key: str, **constraints: Any) -> Any:
    """A settings field that is the run's shared value ``key`` (``RunShared``): its
    default and its one variable (``SF_<KEY>``) are the shared ones, and a run file sets
    it under ``[run]``, not in the class's own section."""
    info = RunShared.model_fields[key]
    return Field(
        default=info.default,
        validation_alias=AliasChoices(shared_variable(key)),
        json_schema_extra={SHARED_KEY: key},
        **constraints,
    )


def shared_key(info: FieldInfo) -> str | None:
    """The shared value a settings field is (``shared``), or None."""
    extra = info.json_schema_extra
    return str(extra[SHARED_KEY]) if isinstance(extra, dict) and SHARED_KEY in extra else None


def shared_fields(settings_cls: type[BaseModel]) -> dict[str, str]:
    """Field -> the shared value it is, for every shared field of a settings class."""
    return {
        name: key
        for name, info in settings_cls.model_fields.items()
        if (key := shared_key(info)) is not None
    }


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


def _as_variable_text(value: Any) -> Any:
    """A ``[run]`` value as a service field takes it: a list (policies) comma-separated."""
    return ",".join(map(str, value)) if isinstance(value, list) else value


def check_section(
    path: Path,
    section: str,
    table: dict[str, Any],
    settings_cls: type[BaseModel],
    run_table: Mapping[str, Any] | None = None,
) -> None:
    """Every key of a service section is a field of its class, and not a shared one
    (``[run]`` sets those, once for every process), unless it repeats ``[run]``'s value
    exactly, as a resolved file does (``sf_app.run.spec``)."""
    known = settings_cls.model_fields
    shared_by_field = shared_fields(settings_cls)
    run_table = run_table or {}
    for key, value in table.items():
        if key not in known:
            raise RunFileError(f"run file {path}: unknown key {section}.{key}{nearest(key, known)}")
        run_key = shared_by_field.get(key)
        if run_key is None:
            continue
        if run_key in run_table and _as_variable_text(run_table[run_key]) == value:
            continue  # the resolver's copy of the shared value
        raise RunFileError(
            f"run file {path}: {section}.{key} is a run setting: set it as [run] {run_key}"
        )


def values_for(settings_cls: type[BaseModel], path: Path) -> dict[str, Any]:
    """What the run file at ``path`` sets for a settings class: its section's keys and
    the ``[run]`` keys that are its shared fields (checked as :func:`check_section`)."""
    sections = load(path)
    section = section_of(str(settings_cls.model_config.get("env_prefix", "")))
    table = sections.get(section, {})
    run_table = sections.get(RUN_SECTION, {})
    check_section(path, section, table, settings_cls, run_table)
    values = dict(table)
    for field, key in shared_fields(settings_cls).items():
        if key in run_table:
            values[field] = _as_variable_text(run_table[key])
    return values


def run_file_from_environment() -> Path | None:
    """The run file ``SF_CONFIG`` names (None: unset or empty)."""
    value = os.environ.get(RUN_FILE_VARIABLE, "")
    return Path(value) if value else None


def variable(settings_cls: type[BaseModel], field: str) -> str:
    """The one environment variable that sets ``field`` of a settings class: its alias
    (a shared field's ``SF_<KEY>``), else its prefix and name. Code that hands a setting
    to a process by variable takes the name from here, not from its own spelling."""
    info = settings_cls.model_fields[field]  # KeyError: not a field of that class
    alias = info.validation_alias
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    if isinstance(alias, str):
        return alias
    return f"{settings_cls.model_config.get('env_prefix', '')}{field}".upper()


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
        values = values_for(self.settings_cls, path)
        return {_input_key(fields[name], name): value for name, value in values.items()}


class RunFileSettings(BaseSettings):
    """Settings read from the environment, then from the run file (``SF_CONFIG``), then
    their defaults. Every settings class of the mesh derives from it."""

    retired: ClassVar[Mapping[str, str]] = {}
    """Fields no longer read -> the one line naming their new spelling. Set in the
    environment or in the class's run-file section, they stop the process with that
    line instead of being ignored without a word."""

    model_config = SettingsConfigDict(populate_by_name=True)
    """Fields are given by name in code (``TrainerSettings(lr=...)``) and by their one
    variable in the environment (a shared field's is ``SF_<KEY>``)."""

    @model_validator(mode="after")
    def _no_retired_variables(self) -> RunFileSettings:
        prefix = str(self.model_config.get("env_prefix", ""))
        for field, line in self.retired.items():
            if f"{prefix}{field.upper()}" in os.environ:
                raise ValueError(line)
        for field, key in shared_fields(type(self)).items():
            own = f"{prefix}{field}".upper()
            if own != shared_variable(key) and own in os.environ:
                raise ValueError(
                    f"{own} is no longer read: the run's {key} is {shared_variable(key)}, "
                    "one for every process"
                )
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
