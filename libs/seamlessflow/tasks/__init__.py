"""Task sources: where prompts and their references come from.

A task source is named, knows which reward function (see `seamlessflow.rewards`) scores
its completions, and yields `TaskItem`s for a split ("train" or "eval"). Items are
deterministic given the seed the source was built with, and the splits are disjoint.

Besides the registered sources ("arithmetic", "counting", "lookup", and "episodes":
seeds of environment episodes, ``seamlessflow.tasks.episodes``), a task name can point to a
local JSONL or Parquet file: ``path/to/tasks.jsonl?reward=math_answer`` (see
`seamlessflow.tasks.files` for the columns, splits and reward selection), or name a
reasoning-gym dataset: ``rg:basic_arithmetic?max_digits=2`` (see
`seamlessflow.tasks.reasoning_gym`), or ask whether a proposed answer to another task's
question is right: ``verify:arithmetic`` (a verifier's task, `seamlessflow.tasks.verify`).
A source may also name ``eval_reward_fn``, the reward
the trainer's held-out evaluation reports (an accuracy without training-only terms);
``reward_fn`` otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from seamlessflow.plugins import Registry, UnknownPlugin

SPLITS = ("train", "eval")


@dataclass(frozen=True)
class TaskItem:
    """One prompt: the chat messages to send and the reference the verifier checks."""

    task_id: str
    messages: tuple[dict[str, str], ...]  # OpenAI chat messages: {"role", "content"}
    reference: str


class TaskSource(Protocol):
    name: str
    reward_fn: str  # a name (or dotted path) understood by `seamlessflow.rewards.get_reward`

    def items(self, split: str) -> list[TaskItem]: ...


class ToolTaskSource(TaskSource, Protocol):
    """A task source whose items are solved with tools, over several turns (optional
    extras; see ``seamlessflow.tasks.lookup``).

    - ``tools``: the OpenAI ``tools`` list agents send with their requests;
    - ``max_tokens``: a completion budget per call that fits a tool call;
    - ``sft_version``: a string naming the teacher, for the base model's build hash;
    - ``sft_conversation(item, rng, p_correct)``: one full chat (question, assistant tool
      calls, tool messages, final answer) from a teacher right with probability
      ``p_correct``; the base model's warm-up trains on its assistant turns;
    - ``call_tool(name, arguments)``: the tools' implementation (a pure function).
    """

    tools: list[dict[str, Any]]
    max_tokens: int
    sft_version: str

    def sft_conversation(
        self, task: TaskItem, rng: random.Random, p_correct: float
    ) -> list[dict[str, Any]]: ...

    def call_tool(self, name: str, arguments: str | dict[str, Any]) -> str: ...


class TeacherTaskSource(TaskSource, Protocol):
    """A single-turn task source whose answers are more than the reference (a worked
    answer; see ``seamlessflow.tasks.counting``), with optional extras for the base
    model's warm-up:

    - ``max_tokens``: the completion budget its answers need;
    - ``sft_version``: a string naming the teacher, for the base model's build hash;
    - ``sft_completion(item, rng, p_correct)``: the teacher's answer to ``item``, each of
      its decisions right with probability ``p_correct``.
    """

    max_tokens: int
    sft_version: str

    def sft_completion(self, task: TaskItem, rng: random.Random, p_correct: float) -> str: ...


def seeded_split(
    items: list[TaskItem], seed: int, eval_fraction: float
) -> dict[str, list[TaskItem]]:
    """The built-in sources' split: ``items`` shuffled once with ``seed``, the first
    ``eval_fraction`` of them "eval" and the rest "train" (disjoint, deterministic)."""
    order = list(items)
    random.Random(seed).shuffle(order)
    n_eval = int(len(order) * eval_fraction)
    return {"eval": order[:n_eval], "train": order[n_eval:]}


def split_of(splits: dict[str, list[TaskItem]], split: str) -> list[TaskItem]:
    """A copy of ``splits[split]``; an unknown split name is a ValueError naming both."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return list(splits[split])


def fraction_option(
    task: str, key: str, text: str | None, default: float, error: type[ValueError] = ValueError
) -> float:
    """A task name's option ``key`` that is a fraction in [0, 1) (``default`` when the name
    does not give it); anything else raises ``error`` naming the task and the option."""
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise error(f"task {task!r}: {key} must be in [0, 1), got {text!r}")
    return value


TASKS: Registry[Callable[[int], TaskSource]] = Registry(
    "task",
    "SF_TASK, --task",
    hint=(
        "or a data file: [jsonl:|parquet:]PATH[?reward=NAME] (PATH ending .jsonl / .parquet); "
        "or a reasoning-gym dataset: rg:DATASET[?key=value&...]; "
        "or a verifier's task: verify:TASK"
    ),
)
"""Factories by name, each building its source with a seed; they import lazily so that
listing the registry imports nothing else."""


@TASKS.register("arithmetic")
def _arithmetic(seed: int) -> TaskSource:
    from seamlessflow.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask(seed=seed)


@TASKS.register("counting")
def _counting(seed: int) -> TaskSource:
    from seamlessflow.tasks.counting import CountingTask

    return CountingTask(seed=seed)


@TASKS.register("lookup")
def _lookup(seed: int) -> TaskSource:
    from seamlessflow.tasks.lookup import LookupTask

    return LookupTask(seed=seed)


@TASKS.register("episodes")
def _episodes(seed: int) -> TaskSource:
    from seamlessflow.tasks.episodes import EpisodeSeeds

    return EpisodeSeeds(seed=seed)


task_names = TASKS.names


def get_task_source(name: str, seed: int = 0) -> TaskSource:
    """The task source registered as `name`, built with `seed`; the reasoning-gym
    dataset an ``rg:`` name names, built with `seed` (`seamlessflow.tasks.reasoning_gym`);
    the verification of the task a ``verify:`` name names (`seamlessflow.tasks.verify`);
    or the data file `name` points to (`seamlessflow.tasks.files`; its split does not
    depend on the seed)."""
    factory = TASKS.find(name)
    if factory is not None:
        return factory(seed)
    if name.startswith("verify:"):
        from seamlessflow.tasks.verify import PREFIX, VerifyTask

        return VerifyTask(get_task_source(name.removeprefix(PREFIX), seed), seed=seed)
    if name.startswith("rg:"):
        from seamlessflow.tasks.reasoning_gym import ReasoningGymTask

        return ReasoningGymTask(name, seed=seed)
    from seamlessflow.tasks.files import load_file_task, parse_file_task_name

    if parse_file_task_name(name) is not None:
        return load_file_task(name)
    raise UnknownPlugin(TASKS.unknown_message(name))
