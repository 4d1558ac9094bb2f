"""Task sources: where prompts and their references come from.

A task source is named, knows which reward function (see `seamlessflow.rewards`) scores
its completions, and yields `TaskItem`s for a split ("train" or "eval"). Items are
deterministic given the seed the source was built with, and the splits are disjoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

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


def _arithmetic(seed: int) -> TaskSource:
    from seamlessflow.tasks.arithmetic import ArithmeticTask

    return ArithmeticTask(seed=seed)


# Factories import lazily so that listing the registry imports nothing else.
_REGISTRY: dict[str, Callable[[int], TaskSource]] = {"arithmetic": _arithmetic}


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task_source(name: str, seed: int = 0) -> TaskSource:
    """The task source registered as `name`, built with `seed`."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown task {name!r}; known tasks: {', '.join(task_names())}") from None
    return factory(seed)
