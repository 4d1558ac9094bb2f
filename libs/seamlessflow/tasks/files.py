"""Task sources from local data files: JSON Lines or Parquet, read with Hugging Face
``datasets`` (``load_dataset("json" | "parquet", data_files=..., split="train")``).

**Naming a file task** (``SF_TASK``, ``seamlessflow up --task``)::

    [jsonl:|parquet:]PATH[?reward=NAME][&eval_fraction=F]

The format comes from the prefix, else from the suffix (``.jsonl``, ``.parquet``). A
relative PATH is relative to the working directory of the process that loads it.
``reward`` is a registered reward name or a dotted path (``seamlessflow.rewards``);
``eval_fraction`` (default ``DEFAULT_EVAL_FRACTION``) is the share of rows held out
for evaluation. Examples: ``examples/data/math.jsonl``,
``parquet:/data/mbpp.pq?reward=code_tests&eval_fraction=0.05``.

**Columns** (others are ignored; one row is one task):
- the prompt: ``messages`` (a list of ``{"role", "content"}`` chat messages that must not
  end with an assistant message) or else ``prompt`` (a string, sent as one user
  message, or a list of messages as in TRL's conversational format);
- the verifier's reference: ``reference`` or else ``answer`` (a string; numbers are
  written as JSON, objects and lists as JSON text - the ``code_tests`` form);
- ``id`` (optional): the task id; default ``<file stem>-<hash of prompt and reference>``,
  so identical rows share an id. Explicit ids must be unique;
- ``reward_fn`` (optional): the reward function for the file; every non-empty value must
  be the same (one source has one reward function, which the dispatcher sends with each
  task).

**Reward selection**: ``?reward=`` in the task name, else the file's ``reward_fn``
column, else an error (no silent default: a wrong verifier trains silently wrong).
The reward is looked up when the file loads, so a typo fails at start-up.

**Splits** are decided per row by a hash of its task id: the row is in "eval" iff
``sha256(id)`` (as a fraction of 2**64) is below ``eval_fraction``. The splits are
disjoint and deterministic, do not depend on the run seed (runs with different seeds
evaluate on the same rows) or on the other rows (appending rows moves no existing row
across splits). Items keep the file's order; the dispatcher shuffles per epoch.

**No network**: only local files are read, into a temporary ``datasets`` cache that is
deleted after loading (the rows are held in memory as ``TaskItem``s), so loading
writes nothing outside the temporary directory and needs no hub.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from seamlessflow.tasks import SPLITS, TaskItem, fraction_option

FORMATS = {"jsonl": "json", "parquet": "parquet"}
"""Our format name -> the ``datasets`` builder that reads it."""
SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
DEFAULT_EVAL_FRACTION = 0.1
OPTIONS = ("reward", "eval_fraction")
PROMPT_COLUMNS = ("messages", "prompt")
REFERENCE_COLUMNS = ("reference", "answer")
ID_COLUMN = "id"
REWARD_COLUMN = "reward_fn"


class TaskFileError(ValueError):
    """A task file that cannot be used; the message names the file (and row, column)."""


@dataclass(frozen=True)
class FileTaskSpec:
    """A file task name, parsed."""

    path: Path
    file_format: str
    reward_fn: str | None
    eval_fraction: float


def parse_file_task_name(name: str) -> FileTaskSpec | None:
    """The spec of a file task name; None if ``name`` does not name a data file."""
    location, _, query = name.partition("?")
    prefix, colon, rest = location.partition(":")
    if colon and prefix in FORMATS:
        path, file_format = Path(rest), prefix
    elif Path(location).suffix in SUFFIXES:
        path, file_format = Path(location), SUFFIXES[Path(location).suffix]
    else:
        return None
    try:
        options = dict(parse_qsl(query, strict_parsing=True)) if query else {}
    except ValueError:
        raise TaskFileError(f"task {name!r}: cannot parse options {query!r}") from None
    unknown = set(options) - set(OPTIONS)
    if unknown:
        raise TaskFileError(f"task {name!r}: unknown options {sorted(unknown)}; known: {OPTIONS}")
    return FileTaskSpec(
        path=path,
        file_format=file_format,
        reward_fn=options.get("reward"),
        eval_fraction=_eval_fraction(name, options.get("eval_fraction")),
    )


def _eval_fraction(name: str, text: str | None) -> float:
    return fraction_option(name, "eval_fraction", text, DEFAULT_EVAL_FRACTION, TaskFileError)


@dataclass
class FileTask:
    """The tasks of one data file (module docstring); ``items`` copies its split."""

    name: str
    reward_fn: str
    path: Path
    _splits: dict[str, list[TaskItem]] = field(repr=False)

    def items(self, split: str) -> list[TaskItem]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        return list(self._splits[split])


def load_file_task(name: str) -> FileTask:
    """Read the data file a file task name points to; ``TaskFileError`` if it cannot be
    used. The split does not depend on a seed (module docstring)."""
    spec = parse_file_task_name(name)
    if spec is None:
        raise TaskFileError(f"task {name!r} does not name a .jsonl or .parquet file")
    columns, rows = read_rows(spec.path, spec.file_format)
    _check_columns(spec.path, columns)
    reward_fn = choose_reward(spec, rows)
    items = [task_item(spec.path, number, row) for number, row in enumerate(rows, start=1)]
    _check_unique_ids(spec.path, rows, items)
    splits: dict[str, list[TaskItem]] = {split: [] for split in SPLITS}
    for item in items:
        splits["eval" if in_eval_split(item.task_id, spec.eval_fraction) else "train"].append(item)
    if not splits["train"]:
        raise TaskFileError(f"{spec.path}: no row is left for training (eval_fraction too high)")
    return FileTask(name=name, reward_fn=reward_fn, path=spec.path, _splits=splits)


def read_rows(path: Path, file_format: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The file's column names and rows, through ``datasets``, offline."""
    if not path.exists():
        raise TaskFileError(f"task file {path} does not exist (working directory: {Path.cwd()})")
    if not path.is_file():
        raise TaskFileError(f"task file {path} is not a file")
    with open(path, "rb") as file:
        head = file.read(4096)
    if not head.strip():
        raise TaskFileError(f"task file {path} is empty")
    import datasets

    with tempfile.TemporaryDirectory(prefix="sf-datasets-") as cache, _quiet_progress():
        try:
            dataset = datasets.load_dataset(
                FORMATS[file_format], data_files=str(path), split="train", cache_dir=cache
            )
        except Exception as error:  # datasets and pyarrow raise many types; keep the cause
            raise TaskFileError(
                f"task file {path} cannot be read as {file_format}: {_root_cause(error)}"
            ) from error
        rows = dataset.to_list()
        columns = list(dataset.column_names)
    if not rows:
        raise TaskFileError(f"task file {path} has no rows")
    return columns, rows


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """No progress bars while a file loads (they would interleave with service logs)."""
    import datasets

    was_disabled = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_disabled:
            datasets.enable_progress_bars()


def _root_cause(error: BaseException) -> str:
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return f"{type(error).__name__}: {error}"


def _check_columns(path: Path, columns: list[str]) -> None:
    for wanted in (PROMPT_COLUMNS, REFERENCE_COLUMNS):
        if not set(wanted) & set(columns):
            raise TaskFileError(
                f"task file {path} has no {' or '.join(repr(c) for c in wanted)} column "
                f"(its columns: {', '.join(columns)})"
            )


def choose_reward(spec: FileTaskSpec, rows: list[dict[str, Any]]) -> str:
    """``?reward=``, else the file's one ``reward_fn`` value; checked to resolve."""
    if spec.reward_fn is not None:
        reward_fn = spec.reward_fn
    else:
        named = sorted({str(row[REWARD_COLUMN]) for row in rows if row.get(REWARD_COLUMN)})
        if len(named) > 1:
            raise TaskFileError(
                f"task file {spec.path}: column {REWARD_COLUMN!r} names {named}; a task file "
                "has one reward function (split the file, or choose one with ?reward=NAME)"
            )
        if not named:
            raise TaskFileError(
                f"task file {spec.path}: which reward function scores it? Add ?reward=NAME "
                f"to the task name (e.g. {spec.path}?reward=math_answer) or a "
                f"{REWARD_COLUMN!r} column"
            )
        reward_fn = named[0]
    from seamlessflow.rewards import get_reward

    try:
        get_reward(reward_fn)
    except (ValueError, ImportError, AttributeError, TypeError) as error:
        raise TaskFileError(f"task file {spec.path}: reward {reward_fn!r}: {error}") from error
    return reward_fn


def task_item(path: Path, number: int, row: dict[str, Any]) -> TaskItem:
    """One row as a task; ``number`` (1-based) names the row in errors."""
    where = f"task file {path}, row {number}"
    messages = row_messages(where, row)
    reference = next((row[c] for c in REFERENCE_COLUMNS if row.get(c) is not None), None)
    if reference is None:
        raise TaskFileError(f"{where}: no {' or '.join(REFERENCE_COLUMNS)}")
    reference_text = reference if isinstance(reference, str) else json.dumps(reference)
    task_id = row.get(ID_COLUMN)
    if task_id is None:
        digest = hashlib.sha256(json.dumps([messages, reference_text]).encode()).hexdigest()
        task_id = f"{path.stem}-{digest[:12]}"
    return TaskItem(task_id=str(task_id), messages=messages, reference=reference_text)


def row_messages(where: str, row: dict[str, Any]) -> tuple[dict[str, str], ...]:
    column = next((c for c in PROMPT_COLUMNS if row.get(c) is not None), None)
    if column is None:
        raise TaskFileError(f"{where}: no {' or '.join(PROMPT_COLUMNS)}")
    value = row[column]
    if isinstance(value, str):
        if not value.strip():
            raise TaskFileError(f"{where}: column {column!r} is empty")
        return ({"role": "user", "content": value},)
    if not isinstance(value, list) or not value:
        raise TaskFileError(f"{where}: column {column!r} must be a string or chat messages")
    messages = []
    for message in value:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise TaskFileError(
                f"{where}: column {column!r}: each message needs a string 'role' and "
                f"'content', got {message!r:.200}"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if messages[-1]["role"] == "assistant":
        raise TaskFileError(
            f"{where}: column {column!r} ends with an assistant message; a task's prompt "
            "ends where the model answers"
        )
    return tuple(messages)


def _check_unique_ids(path: Path, rows: list[dict[str, Any]], items: list[TaskItem]) -> None:
    first_row: dict[str, int] = {}
    for number, (row, item) in enumerate(zip(rows, items, strict=True), start=1):
        if row.get(ID_COLUMN) is None:
            continue
        if item.task_id in first_row:
            raise TaskFileError(
                f"task file {path}: rows {first_row[item.task_id]} and {number} have the "
                f"same id {item.task_id!r}"
            )
        first_row[item.task_id] = number


def in_eval_split(task_id: str, eval_fraction: float) -> bool:
    """The split rule: a row is held out iff its id's hash falls below the fraction."""
    digest = hashlib.sha256(task_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2**64
