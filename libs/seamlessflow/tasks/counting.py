"""The built-in task "counting": addition worked out step by step, a long answer.

"What is 37 + 25? Count it out." The answer moves one unit from the right operand to the
left one per line until the right one is 0, then states the sum:

    37+25
    38+24
    ...
    62+0
    Answer: 62

It exists to benchmark the regime RL on reasoning spends its time in: generation-bound,
answers of 64-512 tokens (``b + 1`` lines of 6-8 tokens with the base model's tokenizer,
digits split one by one as Qwen2's pre-tokenizer does), lengths spread over the batch.
Operands: ``a`` in 10..99, ``b`` in 8..64 (5,130 pairs), shuffled once with the seed and
split 80% train / 20% eval, disjoint and deterministic given the seed.

What a small model can learn: every line follows from the line above it alone (add one
to the left number, take one from the right one, decimal carries included), and the
answer copies the last left number. The reward ("math_answer": the number after the last
"Answer:") is 1 only if every step was right, so a policy that slips once in a hundred
steps is right on a 50-line problem 60% of the time: the noisy teacher of the base
model's warm-up (``sft_completion``) slips on purpose, and RL has to make it slip less.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from seamlessflow.tasks import TaskItem, seeded_split, split_of

LEFT_RANGE = range(10, 100)
RIGHT_RANGE = range(10, 73)
EVAL_FRACTION = 0.2
MAX_TOKENS = 512
"""Completion budget: the longest answer (99 + 64: 65 lines) with room to slip."""


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} + {b}? Count it out."


def make_item(a: int, b: int) -> TaskItem:
    return TaskItem(
        task_id=f"count-{a}-{b}",
        messages=({"role": "user", "content": prompt_text(a, b)},),
        reference=str(a + b),
    )


def operands(task: TaskItem) -> tuple[int, int]:
    _, a, b = task.task_id.split("-")
    return int(a), int(b)


def worked_answer(a: int, b: int, rng: random.Random | None = None, p_step: float = 1.0) -> str:
    """The teacher's answer. Each step is right with probability ``p_step`` (drawn from
    ``rng``); a wrong step moves two units, or none, to the left number while the right
    one still loses one, so the stated sum is off by the slips' total."""
    lines = [f"{a}+{b}"]
    while b > 0:
        step = 1
        if rng is not None and rng.random() >= p_step:
            step = rng.choice((0, 2))
        a, b = a + step, b - 1
        lines.append(f"{a}+{b}")
    lines.append(f"Answer: {a}")
    return "\n".join(lines)


@dataclass
class CountingTask:
    seed: int = 0
    name: str = "counting"
    reward_fn: str = "math_answer"
    max_tokens: int = MAX_TOKENS
    """Completion budget per agent call (embedded runs use it)."""
    sft_version: str = "counting-1"
    """Names the teacher below, for the base model's build hash."""
    _splits: dict[str, list[TaskItem]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pairs = [(a, b) for a in LEFT_RANGE for b in RIGHT_RANGE]
        self._splits = seeded_split([make_item(a, b) for a, b in pairs], self.seed, EVAL_FRACTION)

    def items(self, split: str) -> list[TaskItem]:
        return split_of(self._splits, split)

    def sft_completion(self, task: TaskItem, rng: random.Random, p_correct: float) -> str:
        """The warm-up's target for ``task``: the worked answer, each step right with
        probability ``p_correct``."""
        a, b = operands(task)
        return worked_answer(a, b, rng, p_correct)
