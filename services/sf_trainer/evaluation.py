"""Held-out evaluation in the trainer: greedy answers of the policy, scored by the task's
evaluation reward (its ``eval_reward_fn`` where it names one, e.g. an accuracy without the
training reward's format term; else its ``reward_fn``).

The trainer evaluates with its own model (``SF_EVAL_EVERY``), not through the
gateway and the engines: no rollout capacity is taken, the result does not depend on
which version an engine serves at that moment, and it is the same with or without
engines (greedy decoding, so one answer per prompt and no sampling seed). Every rank
runs the same generation (a sharded model all-gathers in each forward); rank 0 reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoTokenizer

from seamlessflow.rewards import get_reward
from seamlessflow.tasks import TaskItem, get_task_source
from sf_trainer.distributed import TrainGroup, forward_precision
from sf_trainer.settings import TrainerSettings


@dataclass(frozen=True)
class EvalSet:
    """What an evaluation runs on: the first ``eval_items`` prompts of each evaluated
    task's eval split, each scored by its own task's evaluation reward."""

    task: str
    """The evaluated tasks, as set (``SF_TRAINER_EVAL_TASK``: one, or several by comma)."""
    items: list[TaskItem]
    reward_fn: str
    """The first task's evaluation reward (of a one-task set: every prompt's)."""
    task_of: tuple[str, ...] = ()
    """Several tasks: each prompt's task, in ``items``' order."""
    reward_fn_by_task: dict[str, str] | None = None
    """Several tasks: each task's evaluation reward."""

    @classmethod
    def from_settings(cls, settings: TrainerSettings, seed: int) -> EvalSet:
        """``seed``: the run's (``SF_SEED``), so the eval split is the one held out of the
        trajectory service's."""
        tasks = settings.eval_tasks()
        items: list[TaskItem] = []
        task_of: list[str] = []
        reward_fn_by_task: dict[str, str] = {}
        for task in tasks:
            source = get_task_source(task, seed=seed)
            task_items = source.items("eval")
            if settings.eval_items:
                task_items = task_items[: settings.eval_items]
            if not task_items:
                raise ValueError(
                    f"evaluation task {settings.evaluated_task}: {task} has no eval items"
                )
            items += task_items
            task_of += [task] * len(task_items)
            reward_fn_by_task[task] = getattr(source, "eval_reward_fn", source.reward_fn)
        if len(tasks) == 1:
            return cls(task=tasks[0], items=items, reward_fn=reward_fn_by_task[tasks[0]])
        return cls(
            task=",".join(tasks),
            items=items,
            reward_fn=reward_fn_by_task[tasks[0]],
            task_of=tuple(task_of),
            reward_fn_by_task=reward_fn_by_task,
        )

    def tasks(self) -> list[str]:
        return list(self.reward_fn_by_task or {self.task: self.reward_fn})

    def scored_by(self) -> list[tuple[str, str]]:
        """Each prompt's (task, evaluation reward), in ``items``' order."""
        if not self.task_of or self.reward_fn_by_task is None:
            return [(self.task, self.reward_fn)] * len(self.items)
        return [(task, self.reward_fn_by_task[task]) for task in self.task_of]


@dataclass(frozen=True)
class EvalResult:
    mean_reward: float
    """Mean reward (the accuracy for a 0/1 reward); over several tasks, the mean of the
    tasks' means, so a task with more prompts does not weigh more."""
    samples: int
    by_task: dict[str, float] = field(default_factory=dict)
    """Several tasks: each task's mean reward over its own prompts."""


def evaluate(
    model: torch.nn.Module,
    model_dir: Path,
    eval_set: EvalSet,
    settings: TrainerSettings,
    group: TrainGroup,
) -> EvalResult:
    """Greedy answers (at most ``eval_max_tokens`` tokens) to every prompt, each scored
    against its reference. The model is put in eval mode for it and back in train mode."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    scored_by = eval_set.scored_by()
    rewards = {name: get_reward(name) for _, name in scored_by}
    totals = dict.fromkeys(eval_set.tasks(), 0.0)
    counts = dict.fromkeys(eval_set.tasks(), 0)
    model.eval()
    try:
        batch = settings.eval_batch_size
        for start in range(0, len(eval_set.items), batch):
            items = eval_set.items[start : start + batch]
            encoded = tokenizer.apply_chat_template(
                [list(item.messages) for item in items],
                add_generation_prompt=True,
                tokenize=True,
                padding=True,
                return_tensors="pt",
                return_dict=True,
            ).to(group.device)  # type: ignore[union-attr]  # return_dict: a BatchEncoding
            with torch.no_grad(), forward_precision(settings.precision == "bf16-mixed", group):
                output = model.generate(  # type: ignore[operator]
                    **encoded,
                    do_sample=False,
                    max_new_tokens=settings.eval_max_tokens,
                    pad_token_id=tokenizer.pad_token_id,
                )
            prompt_length = encoded["input_ids"].shape[1]
            texts = tokenizer.batch_decode(output[:, prompt_length:], skip_special_tokens=True)
            for text, item, (task, reward_fn) in zip(
                texts, items, scored_by[start : start + batch], strict=True
            ):
                totals[task] += rewards[reward_fn](text, item.reference)
                counts[task] += 1
    finally:
        model.train()
    by_task = {task: totals[task] / counts[task] for task in totals}
    return EvalResult(
        mean_reward=sum(by_task.values()) / len(by_task),
        samples=len(eval_set.items),
        by_task=by_task if len(by_task) > 1 else {},
    )
