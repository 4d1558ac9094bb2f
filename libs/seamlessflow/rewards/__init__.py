"""Reward functions: `(completion_text, reference) -> reward in [0, 1]`.

Registered names (``get_reward(name)``; any other importable function by dotted path):
- ``integer_match``, ``code_match``: the built-in tasks' exact matches, and
  ``verdict_match``: a verifier's first yes/no word (``matching``);
- ``math_answer``: final-answer equality for math (``math_verifier``);
- ``code_tests``: the reference's tests run against the completion's code in a
  sandboxed subprocess (``code_verifier``, ``sandbox``);
- ``reasoning_gym``, ``reasoning_gym_accuracy``: a reasoning-gym dataset's own scorer on
  the answer read from the completion, with an optional format term for training
  (``reasoning_gym_verifier``; reasoning-gym is imported when one scores).
"""

from seamlessflow.rewards.code_verifier import code_tests
from seamlessflow.rewards.matching import (
    code_match,
    first_integer,
    first_verdict,
    integer_match,
    verdict_match,
)
from seamlessflow.rewards.math_verifier import math_answer
from seamlessflow.rewards.reasoning_gym_verifier import (
    reasoning_gym_accuracy,
    reasoning_gym_reward,
)
from seamlessflow.rewards.registry import RewardFn, get_reward, register_reward, reward_names

__all__ = [
    "RewardFn",
    "code_match",
    "code_tests",
    "first_integer",
    "first_verdict",
    "get_reward",
    "integer_match",
    "math_answer",
    "reasoning_gym_accuracy",
    "reasoning_gym_reward",
    "register_reward",
    "reward_names",
    "verdict_match",
]
