"""Stages as dispatched: each stage's prompts and reward functions, and which stage
trains a batch. The schedule's grammar (``SF_TRAJECTORY_STAGES``, or a run's task) is
``seamlessflow.tasks.schedule``'s; the dispatcher (``sf_trajectory.dispatch``) switches
stage at a batch boundary.

A stage of several sources holds them in its weights' proportions, as many prompts as the
proportions allow without repeating one (each source's share a seeded sample of its
train split, so a restart rebuilds the same set), each prompt scored by its own source's
reward function. Its task ids are prefixed with their source (``rg:bf/17``), so prompts
of two sources never share an id.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from seamlessflow.tasks import TaskItem, get_task_source
from seamlessflow.tasks.schedule import StageSource, StageSpec, parse_stages

__all__ = ["Stage", "StageSource", "StageSpec", "build_stages", "parse_stages", "stage_of_batch"]


@dataclass(frozen=True)
class Stage:
    """One stage as dispatched: its prompts, their reward functions, its batches."""

    name: str
    items: list[TaskItem]
    reward_fn: str
    """The reward function of the stage's prompts (of a one-source stage: all of them)."""
    first_batch: int
    reward_fn_by_task: dict[str, str] = field(default_factory=dict)
    """A several-source stage: each prompt's own source's reward function, by task id."""

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(f"the task source {self.name!r} has no items")

    def reward_fn_of(self, item: TaskItem) -> str:
        return self.reward_fn_by_task.get(item.task_id, self.reward_fn)

    def reward_fns(self) -> set[str]:
        """Every reward function the stage's prompts name (the service trusts these)."""
        return {self.reward_fn, *self.reward_fn_by_task.values()}


def build_stages(specs: list[StageSpec], seed: int) -> list[Stage]:
    """Resolve each spec's task sources (train split); stage ``s`` starts where ``s-1`` ends."""
    stages = []
    first_batch = 0
    for spec in specs:
        sources = spec.sources()
        if len(sources) == 1:
            source = get_task_source(sources[0].task, seed=seed)
            stage = Stage(
                name=spec.task,
                items=source.items("train"),
                reward_fn=source.reward_fn,
                first_batch=first_batch,
            )
        else:
            stage = _mixed_stage(spec.task, sources, seed, first_batch)
        stages.append(stage)
        first_batch += spec.batches or 0
    return stages


def _mixed_stage(name: str, sources: list[StageSource], seed: int, first_batch: int) -> Stage:
    """A stage of several sources in their weights' proportions: the largest prompt set
    those proportions allow without repeating a prompt, each source's share a seeded
    sample of its train split."""
    splits = []
    for source in sources:
        task_source = get_task_source(source.task, seed=seed)
        items = task_source.items("train")
        if not items:
            raise ValueError(f"stage {name!r}: the task source {source.task!r} has no items")
        splits.append((source, task_source.reward_fn, items))
    total_weight = sum(source.weight for source in sources)
    shares = [source.weight / total_weight for source in sources]
    # the prompt count at which the scarcest source (relative to its share) runs out
    prompts = min(len(items) / share for (_, _, items), share in zip(splits, shares, strict=True))
    mixed: list[TaskItem] = []
    reward_fn_by_task: dict[str, str] = {}
    for index, ((source, reward_fn, items), share) in enumerate(zip(splits, shares, strict=True)):
        count = max(1, int(share * prompts + 1e-9))
        chosen = random.Random(seed * 1_000_003 + index).sample(items, count)
        for item in chosen:
            prefixed = replace(item, task_id=f"{source.task}/{item.task_id}")
            mixed.append(prefixed)
            reward_fn_by_task[prefixed.task_id] = reward_fn
    return Stage(
        name=name,
        items=mixed,
        reward_fn=splits[0][1],
        first_batch=first_batch,
        reward_fn_by_task=reward_fn_by_task,
    )


def stage_of_batch(stages: list[Stage], batch_index: int) -> int:
    """Index of the stage that trains batch ``batch_index``."""
    current = 0
    for index, stage in enumerate(stages):
        if stage.first_batch <= batch_index:
            current = index
    return current
