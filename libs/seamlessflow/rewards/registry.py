"""The reward registry: names and dotted paths to reward functions.

A reward function is ``(completion_text, reference) -> reward in [0, 1]``. Register one
with ``@register_reward("name")``; look one up with ``get_reward``, which takes a
registered name or a dotted path to any importable function ("pkg.mod:fn" or
"pkg.mod.fn"), so a user's reward lives in its own small file and needs no registration.
"""

from __future__ import annotations

from collections.abc import Callable

from seamlessflow.plugins import Registry

RewardFn = Callable[[str, str], float]

REWARDS: Registry[RewardFn] = Registry(
    "reward",
    "a task's reward_fn, SF_TRAJECTORY_REWARD_FNS",
    dotted_paths=True,
    builtins=("seamlessflow.rewards",),
)
register_reward = REWARDS.register
reward_names = REWARDS.names
get_reward = REWARDS.get
"""A registered reward by name, else the function at a dotted path, imported."""
