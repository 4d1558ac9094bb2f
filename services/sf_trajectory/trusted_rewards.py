"""The reward functions a session may name, and nothing else."""

from __future__ import annotations

from seamlessflow.rewards import RewardFn, get_reward, reward_names


class TrustedRewards:
    """The reward functions sessions may name: the registered ones, the stages' and
    ``SF_TRAJECTORY_REWARD_FNS``. A session's ``reward_fn`` is chosen by whoever opened
    it; importing and calling any dotted path it names would run code of their choice
    here (``os:system``...)."""

    def __init__(self, trusted: set[str]) -> None:
        self.trusted = trusted

    def __call__(self, name: str) -> RewardFn:
        if name not in self.trusted and name not in reward_names():
            raise KeyError(
                f"reward function {name!r} is not registered, not a stage's and not in "
                f"SF_TRAJECTORY_REWARD_FNS"
            )
        return get_reward(name)
