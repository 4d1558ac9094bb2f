"""The built-in task "arithmetic": small integer addition.

"What is 7 + 12?" -> "19". Operands are 0..19, so there are 400 distinct prompts and sums
0..38; the reference is the sum as a decimal string and the reward is "integer_match".
The 400 pairs are shuffled once with the seed and split 320 train / 80 eval, so the
splits are disjoint and each is a deterministic function of the seed. Prompts are short
on purpose: the built-in base model is tiny (docs/models.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from seamlessflow.tasks import TaskItem, seeded_split, split_of

MAX_OPERAND = 19
EVAL_FRACTION = 0.2


def prompt_text(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]


def make_item(a: int, b: int) -> TaskItem:
    return TaskItem(
        task_id=f"add-{a}-{b}",
        messages=({"role": "user", "content": prompt_text(a, b)},),
        reference=str(a + b),
    )


@dataclass
class ArithmeticTask:
    seed: int = 0
    name: str = "arithmetic"
    reward_fn: str = "integer_match"
    _splits: dict[str, list[TaskItem]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        pairs = all_pairs()
        self._splits = seeded_split([make_item(a, b) for a, b in pairs], self.seed, EVAL_FRACTION)

    def items(self, split: str) -> list[TaskItem]:
        return split_of(self._splits, split)
