"""SRPO's multi-stage schedule: which task source each trainer batch draws its prompts from.

``SF_TRAJECTORY_STAGES="lookup:100,arithmetic"``: entries separated by commas, each a task
source name (``seamlessflow.tasks.get_task_source``) and, after the last ``:``, how many
batches the stage lasts. Every stage but the last has a count; the last runs to the end
of the run (``total_batches``). Stage ``s`` covers the batches after the earlier stages'
counts: here ``lookup`` trains batches 0-99, ``arithmetic`` batch 100 on.

A task name may itself hold a ``:`` (a dataset path): only a final ``:<digits>`` is a
count. The dispatcher (``sf_trajectory.dispatch``) switches stage at a batch boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from seamlessflow.tasks import TaskItem, get_task_source


@dataclass(frozen=True)
class StageSpec:
    """One stage as configured: a task source name and its length in batches."""

    task: str
    batches: int | None
    """None for the last stage: it lasts to the end of the run."""


@dataclass(frozen=True)
class Stage:
    """One stage as dispatched: its prompts, their reward function, its batches."""

    name: str
    items: list[TaskItem]
    reward_fn: str
    first_batch: int

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(f"the task source {self.name!r} has no items")


def parse_stages(text: str) -> list[StageSpec]:
    """``"lookup:100,arithmetic"`` -> two specs; ``""`` -> none. Raises ValueError."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    specs = [_parse_entry(entry) for entry in entries]
    for spec in specs[:-1]:
        if spec.batches is None:
            raise ValueError(f"stage {spec.task!r} needs a length in batches ({spec.task}:N)")
    if specs and specs[-1].batches is not None:
        raise ValueError(
            f"the last stage ({specs[-1].task!r}) runs to the end of the run: give it no count"
        )
    return specs


def _parse_entry(entry: str) -> StageSpec:
    task, sep, count = entry.rpartition(":")
    if not sep or not count.isdigit():
        return StageSpec(task=entry, batches=None)
    if not task or int(count) < 1:
        raise ValueError(f"stage {entry!r}: expected <task>:<batches>, batches >= 1")
    return StageSpec(task=task, batches=int(count))


def build_stages(specs: list[StageSpec], seed: int) -> list[Stage]:
    """Resolve each spec's task source (train split); stage ``s`` starts where ``s-1`` ends."""
    stages = []
    first_batch = 0
    for spec in specs:
        source = get_task_source(spec.task, seed=seed)
        stages.append(
            Stage(
                name=spec.task,
                items=source.items("train"),
                reward_fn=source.reward_fn,
                first_batch=first_batch,
            )
        )
        first_batch += spec.batches or 0
    return stages


def stage_of_batch(stages: list[Stage], batch_index: int) -> int:
    """Index of the stage that trains batch ``batch_index``."""
    current = 0
    for index, stage in enumerate(stages):
        if stage.first_batch <= batch_index:
            current = index
    return current
