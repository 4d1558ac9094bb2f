"""Held-out evaluation in the trainer: greedy answers of the policy, scored by the task's
evaluation reward (its ``eval_reward_fn`` where it names one, e.g. an accuracy without the
training reward's format term; else its ``reward_fn``).

The trainer evaluates with its own model (``SF_TRAINER_EVAL_EVERY``), not through the
gateway and the engines: no rollout capacity is taken, the result does not depend on
which version an engine serves at that moment, and it is the same with or without
engines (greedy decoding, so one answer per prompt and no sampling seed). Every rank
runs the same generation (a sharded model all-gathers in each forward); rank 0 reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from seamlessflow.rewards import get_reward
from seamlessflow.tasks import TaskItem, get_task_source
from sf_trainer.distributed import TrainGroup, forward_precision
from sf_trainer.settings import TrainerSettings


@dataclass(frozen=True)
class EvalSet:
    """What an evaluation runs on: the first ``eval_items`` prompts of the eval split."""

    task: str
    items: list[TaskItem]
    reward_fn: str

    @classmethod
    def from_settings(cls, settings: TrainerSettings, seed: int) -> EvalSet:
        """``seed``: the run's (``SF_SEED``), so the eval split is the one held out of the
        trajectory service's."""
        source = get_task_source(settings.eval_task, seed=seed)
        items = source.items("eval")
        if settings.eval_items:
            items = items[: settings.eval_items]
        if not items:
            raise ValueError(f"SF_TRAINER_EVAL_TASK={settings.eval_task}: no eval items")
        reward_fn = getattr(source, "eval_reward_fn", source.reward_fn)
        return cls(task=settings.eval_task, items=items, reward_fn=reward_fn)


@dataclass(frozen=True)
class EvalResult:
    mean_reward: float
    """Mean reward over the prompts (the accuracy for a 0/1 reward)."""
    samples: int


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
    reward = get_reward(eval_set.reward_fn)
    total = 0.0
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
            for text, item in zip(texts, items, strict=True):
                total += reward(text, item.reference)
    finally:
        model.train()
    return EvalResult(mean_reward=total / len(eval_set.items), samples=len(eval_set.items))
