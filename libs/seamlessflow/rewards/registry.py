"""The reward registry: names and dotted paths to reward functions.

A reward function is ``(completion_text, reference) -> reward in [0, 1]``. Register one
with ``@register_reward("name")``; look one up with ``get_reward``, which takes a
registered name or a dotted path to any importable function ("pkg.mod:fn" or
"pkg.mod.fn"), so a user's reward lives in its own small file and needs no registration.
"""

from __future__ import annotations

from collections.abc import Callable

from seamlessflow.plugins import import_dotted

RewardFn = Callable[[str, str], float]

_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def decorator(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and _REGISTRY[name] is not fn:
            raise ValueError(f"reward {name!r} is already registered")
        _REGISTRY[name] = fn
        return fn

    return decorator


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name_or_dotted_path: str) -> RewardFn:
    """A registered reward by name, else the function at a dotted path, imported."""
    if name_or_dotted_path in _REGISTRY:
        return _REGISTRY[name_or_dotted_path]
    fn = import_dotted(name_or_dotted_path)
    if fn is None:
        raise KeyError(
            f"unknown reward {name_or_dotted_path!r}; registered rewards: "
            f"{', '.join(reward_names())}; or give a dotted path 'package.module:function'"
        )
    return fn
