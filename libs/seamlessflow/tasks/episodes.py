"""The task source "episodes": seeds of environment episodes, for agents that play in an
environment server (the ``openenv`` agent, ``seamlessflow up --env``).

An item is one game to play: ``task_id`` ``episode-<seed>``, the seed as its
``reference`` (the agent resets the environment with it, so every sample of a GRPO group
plays the same game), and a system prompt as its messages; the environment's first
observation is the first user message. The reward is the episode's return, reported by
the agent: the source names no reward function (a finished episode without a reward is
dropped, ``no_reward``). Seeds are drawn once from the source's seed, train and eval
disjoint.
"""

from __future__ import annotations

import random

from seamlessflow.tasks import TaskItem, split_of

SYSTEM_PROMPT = (
    "You are playing a game. Each message from the user is what the game shows you. "
    "Reply with your move only."
)
TRAIN_EPISODES = 8192
EVAL_EPISODES = 1024
SEED_RANGE = 2**31


def episode_item(seed: int) -> TaskItem:
    return TaskItem(
        task_id=f"episode-{seed}",
        messages=({"role": "system", "content": SYSTEM_PROMPT},),
        reference=str(seed),
    )


class EpisodeSeeds:
    name = "episodes"
    reward_fn = ""
    """None: the agent reports the episode's return."""

    def __init__(self, seed: int = 0) -> None:
        seeds = random.Random(seed).sample(range(SEED_RANGE), TRAIN_EPISODES + EVAL_EPISODES)
        self._splits = {
            "train": [episode_item(s) for s in seeds[:TRAIN_EPISODES]],
            "eval": [episode_item(s) for s in seeds[TRAIN_EPISODES:]],
        }

    def items(self, split: str) -> list[TaskItem]:
        return split_of(self._splits, split)
