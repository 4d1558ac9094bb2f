"""Verification of another task's answers, as a task: ``verify:<task>``.

A verifier policy (the second policy of ``solve_and_verify``, multi-policy) is asked
whether a proposed answer to a question is right and replies with one word: yes or no.
This source turns any task with integer answers into that question, with the proposed
answers of a **fixed solver**:

- each item is one of ``<task>``'s questions with one proposed answer, worded as
  ``verifier_messages`` words it (the exact prompt ``solve_and_verify`` sends);
- the proposed answer is the reference's integer on every other item of a split, and on
  the others that integer moved by 1 to 5 either way (a near miss, the kind of wrong
  answer a small model gives); so each split is half right, half wrong, and a verifier
  that always says the same thing scores 0.5;
- the reference is the verdict (``"yes"`` or ``"no"``) that ``<task>``'s own reward
  gives the proposed answer (what ``solve_and_verify`` rewards the verifier against), and
  the reward is ``verdict_match``: the reply's first whole word "yes" or "no", as there.

Why this wording (greedy SmolLM2-135M-Instruct on 32 held-out items of the main job's
task): asked to "reply 1 for yes, 0 for no" under the question, it solves the question
instead, and its first integer is a number from it (1 item scored); with the proposed
answer after "Proposed answer:" it copies the answer's form ("The answer is 2.", 25 of
32 without a verdict). With the judge's role in a system prompt and the answer quoted as
someone's reply, 31 of 32 replies hold a verdict ("No, the answer is 2."), all of them
"no" (0.50): training starts from replies of the right form, with the judging itself
to learn.

What it is for: the held-out evaluation of a verifier (``RunConfig.eval_tasks``, e.g.
``verifier=verify:arithmetic``: the same items for every run, whatever its solver
answered), and training a verifier alone, against this fixed solver, as the separate-run
arm of the multi-policy comparison (``loadtests/multi_policy_compare.py``).

Splits follow ``<task>``'s (disjoint, deterministic for the seed); items whose reference
holds no integer are left out, and a task left with none in a split is a ValueError.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from seamlessflow.rewards import first_integer, get_reward
from seamlessflow.tasks import SPLITS, TaskItem, TaskSource

PREFIX = "verify:"
VERDICT_YES, VERDICT_NO = "yes", "no"
VERIFIER_SYSTEM_PROMPT = (
    "You check other people's answers. Reply with one word: "
    f"{VERDICT_YES} if the proposed answer is right, {VERDICT_NO} if it is wrong."
)
NEAR_MISS = (1, 5)
"""How far a wrong proposed answer is from the right one (either way)."""


def verifier_messages(question: str, proposed: str) -> list[dict[str, Any]]:
    """The verifier's prompt: its role and the verdict's form (system), then the question
    and the proposed answer (user)."""
    content = f'Question: {question}\nSomeone replied: "{proposed.strip()}"\nIs that reply right?'
    return [
        {"role": "system", "content": VERIFIER_SYSTEM_PROMPT},
        {"role": "user", "content": content},
    ]


def question_of(messages: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> str:
    """What a task's messages ask: its user turns (a system prompt is left out)."""
    return "\n".join(str(m.get("content", "")) for m in messages if m["role"] == "user")


def reference_answer(reference: str) -> str:
    """The answer a reference holds: a reasoning-gym reference's ``answer``, else the
    reference itself (the built-in tasks' references are their answers)."""
    if reference.lstrip().startswith("{"):
        from seamlessflow.rewards.reasoning_gym_verifier import RgReference

        try:
            return str(RgReference.from_json(reference).answer)
        except ValueError:
            pass
    return reference


@dataclass
class VerifyTask:
    """``verify:<inner>``: the inner task's questions, each with a fixed solver's
    proposed answer, to be judged right (1) or wrong (0)."""

    inner: TaskSource
    seed: int = 0
    name: str = ""
    reward_fn: str = "verdict_match"
    _splits: dict[str, list[TaskItem]] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.name = self.name or f"{PREFIX}{self.inner.name}"

    def items(self, split: str) -> list[TaskItem]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if split not in self._splits:
            self._splits[split] = self._build(split)
        return list(self._splits[split])

    def _build(self, split: str) -> list[TaskItem]:
        judge = get_reward(self.inner.reward_fn)
        rng = random.Random(f"{self.seed}/{self.name}/{split}")
        items: list[TaskItem] = []
        for item in self.inner.items(split):
            answer = first_integer(reference_answer(item.reference))
            if answer is None:
                continue
            right = len(items) % 2 == 0
            proposed = answer if right else answer + rng.choice((-1, 1)) * rng.randint(*NEAR_MISS)
            text = f"The answer is {proposed}."
            verdict = VERDICT_YES if judge(text, item.reference) >= 1.0 else VERDICT_NO
            kind = "right" if verdict == VERDICT_YES else "wrong"
            items.append(
                TaskItem(
                    task_id=f"verify-{kind}/{item.task_id}",
                    messages=tuple(verifier_messages(question_of(item.messages), text)),
                    reference=verdict,
                )
            )
        if not items:
            raise ValueError(f"task {self.name!r}: {self.inner.name!r} has no {split} item "
                             "whose reference is an integer, nothing to verify")  # fmt: skip
        return items
