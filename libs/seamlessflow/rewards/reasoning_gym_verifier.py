"""The verifiers of reasoning-gym tasks (``seamlessflow.tasks.reasoning_gym``): each
dataset's own scorer, ``score_answer(answer, entry)``, on the answer read from the
completion.

Registered rewards:
- ``reasoning_gym`` (training): ``(1 - w) * score + w * formatted``, where ``w`` is the
  task's ``format_reward`` (default 0: the scorer alone);
- ``reasoning_gym_accuracy`` (held-out evaluation): the scorer alone, whatever ``w``.

**The reference** (``RgReference``, JSON text) carries what the scorer needs: the dataset
name, its configuration options as written in the task name (``config``), the item's
``answer`` and ``metadata``, and how the answer is read (``answer_format``,
``format_reward``). The scorer is the dataset rebuilt from its name and options (one
item, seed 0: ``score_answer`` reads the entry and the configuration, not the generated
items), cached per (name, options). Through this path the items' own answers score 1 in
every dataset whose items carry one (checked with reasoning-gym 0.1.25). The
metadata keeps its Python shape across JSON (tuples, sets, non-string dict keys are
tagged, so a scorer comparing tuples still matches); what JSON cannot hold otherwise is
converted (numpy values to numbers and lists, enums to their values, dataclasses to
dicts, anything else to its ``str``).

**Reading the answer** (``answer_format``):
- ``tag``: the text inside the last ``<answer>...</answer>`` pair (the last ``</answer>``
  and the nearest ``<answer>`` before it), stripped; no closing tag is no answer. This is
  reasoning-gym's own convention (its ``extract_answer`` and system prompts). The format
  term is 1 only for exactly one ``<answer>`` then one ``</answer>``, a non-empty answer
  between them and nothing but whitespace after: what the system prompt asks for;
- ``last_line``: the last non-empty line, stripped. Every non-empty completion has one,
  so there is no format term (a task refuses ``format_reward`` with it);
- ``last_number``: the last number written anywhere in the completion (an optional
  minus sign, digits with optional thousands commas, an optional decimal part; the
  commas dropped), for datasets whose answers are numbers. It is the lenient reading
  evaluations of small models use for math word problems (lm-evaluation-harness's
  "flexible extract" for GSM8K): a model that works the sum out in a sentence ("7 + 12 =
  19, so the answer is 19.") is scored on its result, not on whether it obeyed a
  format. Its format term, when asked for, is 1 iff the last line is that number alone.

A completion never makes a reward raise: a scorer that fails on the answer scores 0. A
malformed reference does (``ValueError``): that is a bug in the data, not a bad answer.
reasoning-gym is imported on first use only.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import enum
import functools
import json
import logging
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from seamlessflow.plugins import UnknownPlugin
from seamlessflow.rewards.registry import register_reward

log = logging.getLogger(__name__)

ANSWER_FORMATS = ("tag", "last_line", "last_number")
OPEN_TAG, CLOSE_TAG = "<answer>", "</answer>"
RUN_CONTROLLED_FIELDS = ("seed", "size")
"""Fields of every dataset configuration that the task sets itself (the run's seed, the
split's size); a task name cannot set them as dataset options."""
SCORER_CACHE_SIZE = 64
"""Datasets kept for scoring, one per (name, options)."""

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?")
"""A number as ``last_number`` reads it: thousands commas only in groups of three."""

# The JSON tags that keep the metadata's Python shape (a one-key object)
_TUPLE, _SET, _FROZENSET, _PAIRS = "__tuple__", "__set__", "__frozenset__", "__pairs__"
_TAGS = (_TUPLE, _SET, _FROZENSET, _PAIRS)


# ----------------------------------------------------------------- reading the answer


def extract_answer(completion_text: str, answer_format: str) -> str | None:
    """The answer read from a completion (module docstring), or None if it states none."""
    if answer_format == "tag":
        end = completion_text.rfind(CLOSE_TAG)
        start = completion_text.rfind(OPEN_TAG, 0, end) if end >= 0 else -1
        if start < 0:
            return None
        return completion_text[start + len(OPEN_TAG) : end].strip()
    if answer_format == "last_line":
        lines = [line.strip() for line in completion_text.splitlines() if line.strip()]
        return lines[-1] if lines else None
    if answer_format == "last_number":
        numbers = _NUMBER.findall(completion_text)
        return numbers[-1].replace(",", "") if numbers else None
    raise ValueError(f"unknown answer format {answer_format!r}; expected one of {ANSWER_FORMATS}")


def stated_in_format(completion_text: str, answer_format: str) -> bool:
    """Whether the completion states its answer as its system prompt asks (the format
    term; module docstring)."""
    if answer_format == "last_number":
        number = extract_answer(completion_text, answer_format)
        last_line = extract_answer(completion_text, "last_line")
        return (
            number is not None and last_line is not None and (last_line.replace(",", "") == number)
        )
    if answer_format != "tag":
        return extract_answer(completion_text, answer_format) is not None
    if completion_text.count(OPEN_TAG) != 1 or completion_text.count(CLOSE_TAG) != 1:
        return False
    _, _, after = completion_text.partition(OPEN_TAG)
    answer, closed, rest = after.partition(CLOSE_TAG)
    return bool(closed) and bool(answer.strip()) and not rest.strip()


# ----------------------------------------------------------------- the reference


def encode_value(value: Any) -> Any:
    """``value`` as JSON data that ``decode_value`` turns back into the same Python
    shape (tuples, sets, non-string keys tagged); other objects converted, lossily."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {_TUPLE: [encode_value(v) for v in value]}
    if isinstance(value, set | frozenset):
        tag = _SET if isinstance(value, set) else _FROZENSET
        return {tag: [encode_value(v) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not _tagged(value):
            return {k: encode_value(v) for k, v in value.items()}
        return {_PAIRS: [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if isinstance(value, enum.Enum):
        return encode_value(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encode_value(dataclasses.asdict(value))
    if callable(getattr(value, "tolist", None)):  # numpy arrays and scalars
        return encode_value(value.tolist())
    return str(value)


def _tagged(value: dict[str, Any]) -> bool:
    return len(value) == 1 and next(iter(value)) in _TAGS


def decode_value(value: Any) -> Any:
    """The inverse of ``encode_value`` on JSON data (``json.loads``'s output)."""
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if not isinstance(value, dict):
        return value
    if _tagged(value):
        ((tag, items),) = value.items()
        if tag == _TUPLE:
            return tuple(decode_value(v) for v in items)
        if tag == _SET:
            return {decode_value(v) for v in items}
        if tag == _FROZENSET:
            return frozenset(decode_value(v) for v in items)
        return {_hashable(decode_value(k)): decode_value(v) for k, v in items}
    return {k: decode_value(v) for k, v in value.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, list) else key


@dataclass(frozen=True)
class RgReference:
    """What a reasoning-gym item's reward needs, carried as ``TaskItem.reference``."""

    dataset: str
    config: dict[str, str]
    """The dataset's own configuration options as written in the task name (%-decoded)."""
    answer: Any
    metadata: dict[str, Any]
    answer_format: str
    format_reward: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "dataset": self.dataset,
                "config": self.config,
                "answer": encode_value(self.answer),
                "metadata": encode_value(self.metadata),
                "answer_format": self.answer_format,
                "format_reward": self.format_reward,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RgReference:
        """Raises ValueError when ``text`` is not a reasoning-gym task's reference."""
        try:
            data = json.loads(text)
            reference = cls(
                dataset=data["dataset"],
                config=dict(data["config"]),
                answer=decode_value(data["answer"]),
                metadata=decode_value(data["metadata"]),
                answer_format=data["answer_format"],
                format_reward=float(data["format_reward"]),
            )
        except (ValueError, TypeError, KeyError) as error:
            raise ValueError(f"not a reasoning-gym reference ({error}): {text!r:.200}") from None
        if not (
            isinstance(reference.dataset, str)
            and all(isinstance(v, str) for v in reference.config.values())
            and isinstance(reference.metadata, dict)
            and reference.answer_format in ANSWER_FORMATS
            and 0.0 <= reference.format_reward < 1.0
        ):
            raise ValueError(f"malformed reasoning-gym reference: {text!r:.200}")
        return reference

    def entry(self) -> dict[str, Any]:
        """The item as the dataset's scorer reads it."""
        return {"answer": self.answer, "metadata": self.metadata}


# ----------------------------------------------------------------- building datasets


def dataset_registry() -> dict[str, tuple[type, type]]:
    """reasoning-gym's datasets: name -> (dataset class, configuration dataclass)."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as error:
        raise ImportError(
            "rg: tasks need reasoning-gym: install the 'reasoning' extra "
            "(pip install 'seamlessflow[reasoning]')"
        ) from error
    return DATASETS


def dataset_classes(dataset: str) -> tuple[type, type]:
    """The dataset's class and configuration class; ``UnknownPlugin`` naming the closest
    datasets when reasoning-gym has no dataset of that name."""
    datasets = dataset_registry()
    if dataset not in datasets:
        closest = difflib.get_close_matches(dataset, datasets, n=5, cutoff=0.5)
        if closest:
            known = f"closest: {', '.join(closest)}"
        else:
            known = f"known: {', '.join(sorted(datasets))}"
        raise UnknownPlugin(f"unknown reasoning-gym dataset {dataset!r}; {known}")
    return datasets[dataset]


def dataset_fields(dataset: str) -> dict[str, tuple[Any, Any]]:
    """The options a task name may set for ``dataset``: field -> (type, default)."""
    _, config_class = dataset_classes(dataset)
    hints = typing.get_type_hints(config_class)
    return {
        field.name: (hints.get(field.name, field.type), field.default)
        for field in dataclasses.fields(config_class)
        if field.name not in RUN_CONTROLLED_FIELDS
    }


def parse_options(dataset: str, options: Mapping[str, str]) -> dict[str, Any]:
    """The dataset's options (text) as configuration values; ValueError for an unknown
    key or a value its field cannot take, naming the dataset's keys."""
    fields = dataset_fields(dataset)
    values = {}
    for key, text in options.items():
        if key not in fields:
            raise ValueError(
                f"rg:{dataset}: unknown option {key!r}; its options: {', '.join(fields)}"
            )
        hint, default = fields[key]
        try:
            values[key] = parse_value(text, hint, default)
        except ValueError as error:
            raise ValueError(
                f"rg:{dataset}: {key}={text!r}: {error}; its options: {', '.join(fields)}"
            ) from None
    return values


def parse_value(text: str, hint: Any, default: Any = None) -> Any:
    """One option's text as a value of type ``hint``: int, float, bool
    (true/false/1/0/yes/no), str, a Literal's or Enum's choice, ``none`` for an
    Optional, ISO dates and times, and lists / tuples of those, comma-separated."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        members = [arg for arg in args if arg is not type(None)]
        errors = []
        for member in members:
            try:
                return parse_value(text, member, default)
            except ValueError as error:
                errors.append(str(error))
        raise ValueError(" or ".join(errors))
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == text:
                return choice
        raise ValueError(f"expected one of {', '.join(map(str, args))}")
    if _is_sequence(hint):
        return _parse_sequence(text, hint, default)
    if hint is bool:
        return _parse_bool(text)
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError("expected an integer") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError("expected a number") from None
    if hint is str:
        return text
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        for member in hint:
            if text in (member.name, str(member.value)):
                return member
        raise ValueError(f"expected one of {', '.join(str(m.value) for m in hint)}")
    if hint is datetime.date:
        return _iso(datetime.date.fromisoformat, text, "a date (YYYY-MM-DD)")
    if hint is datetime.time:
        return _iso(datetime.time.fromisoformat, text, "a time (HH:MM[:SS])")
    raise ValueError(f"a {getattr(hint, '__name__', hint)} cannot be set from a task name")


def _is_sequence(hint: Any) -> bool:
    return typing.get_origin(hint) in (list, tuple, Sequence) or hint in (list, tuple)


def _parse_sequence(text: str, hint: Any, default: Any) -> list[Any] | tuple[Any, ...]:
    args = [arg for arg in typing.get_args(hint) if arg is not Ellipsis]
    if args:
        element: Any = args[0]
    elif isinstance(default, list | tuple) and default:
        element = type(default[0])
    else:
        element = str
    if _is_sequence(element):
        raise ValueError(f"a {hint} cannot be set from a task name")
    parts = [part.strip() for part in text.split(",")] if text.strip() else []
    values = [parse_value(part, element) for part in parts]
    as_tuple = typing.get_origin(hint) is tuple or hint is tuple or isinstance(default, tuple)
    return tuple(values) if as_tuple else values


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError("expected true or false")


def _iso(parse: Any, text: str, what: str) -> Any:
    try:
        return parse(text)
    except ValueError:
        raise ValueError(f"expected {what}") from None


def build_dataset(dataset: str, options: Mapping[str, str], seed: int, size: int) -> Any:
    """The reasoning-gym dataset ``dataset`` with its options, ``seed`` and ``size``;
    ValueError naming the dataset's keys when its configuration refuses the options."""
    dataset_class, config_class = dataset_classes(dataset)
    values = parse_options(dataset, options)
    try:
        return dataset_class(config=config_class(**values, seed=seed, size=size))
    except (AssertionError, ValueError, TypeError) as error:
        keys = ", ".join(dataset_fields(dataset))
        raise ValueError(
            f"rg:{dataset}: invalid configuration {dict(options)}: "
            f"{error or type(error).__name__}; its options: {keys}"
        ) from None


@functools.lru_cache(maxsize=SCORER_CACHE_SIZE)
def scoring_dataset(dataset: str, options: tuple[tuple[str, str], ...]) -> Any:
    """The dataset whose ``score_answer`` scores items of (``dataset``, ``options``)."""
    return build_dataset(dataset, dict(options), seed=0, size=1)


def dataset_score(reference: RgReference, answer: str | None) -> float:
    """The dataset's own scorer on ``answer``, in [0, 1]; 0 if the scorer fails on it."""
    scorer = scoring_dataset(reference.dataset, tuple(sorted(reference.config.items())))
    try:
        score = float(scorer.score_answer(answer, reference.entry()))
    except Exception as error:  # a scorer may choke on any text a model writes
        log.debug("rg:%s scorer failed on %r: %r", reference.dataset, answer, error)
        return 0.0
    return min(max(score, 0.0), 1.0) if math.isfinite(score) else 0.0


# ----------------------------------------------------------------- the rewards


@register_reward("reasoning_gym")
def reasoning_gym_reward(completion_text: str, reference: str) -> float:
    """Training: ``(1 - w) * score + w * formatted`` (module docstring)."""
    parsed = RgReference.from_json(reference)
    score = dataset_score(parsed, extract_answer(completion_text, parsed.answer_format))
    if not parsed.format_reward:
        return score
    formatted = stated_in_format(completion_text, parsed.answer_format)
    return (1.0 - parsed.format_reward) * score + parsed.format_reward * float(formatted)


@register_reward("reasoning_gym_accuracy")
def reasoning_gym_accuracy(completion_text: str, reference: str) -> float:
    """Held-out evaluation: the dataset's scorer alone on the answer read, no format term."""
    parsed = RgReference.from_json(reference)
    return dataset_score(parsed, extract_answer(completion_text, parsed.answer_format))
