"""From rewards to per-sample advantages: reward shaping, then a named estimator.

Estimators are plug-ins chosen by ``SF_TRAINER_ADVANTAGE`` (a registered name, or a
``package.module:attribute`` that is an :class:`AdvantageEstimator`). Each takes the
rewards of every group of the batch (one 1-D tensor per group, one entry per sample;
groups may differ in size) and its own settings (a ``seamlessflow.plugin_settings``
model, set in ``[trainer.advantage]`` or as ``SF_TRAINER_ADVANTAGE__<KEY>``; the
built-in ones have none), and returns each sample's advantage in the same shapes.
Every rank holds the whole batch, so a batch-wide statistic (REINFORCE++) is the same on
every rank without a collective.

Before the estimator, DAPO's soft overlong punishment (``SF_TRAINER_OVERLONG_*``) is
added to each sample's reward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic

import msgspec
import torch

from seamlessflow.plugin_settings import (
    NoSettings,
    PluginChoice,
    PluginSettings,
    Settings,
    settings_of,
)
from seamlessflow.plugins import Registry, first_paragraph
from seamlessflow.protocol import SampleGroup, TrainSample

if TYPE_CHECKING:
    from sf_trainer.settings import TrainerSettings

ADVANTAGE_VARIABLE = "SF_TRAINER_ADVANTAGE"

STD_EPS = 1e-6
"""Added to a standard deviation before dividing by it: rewards without spread give 0."""

Estimate = Callable[[list[torch.Tensor], Settings], list[torch.Tensor]]


@dataclass(frozen=True)
class AdvantageEstimator(Generic[Settings]):
    """An estimator: ``estimate(group rewards, settings)`` and its settings class."""

    estimate: Estimate[Settings]
    settings_class: type[Settings] = NoSettings  # type: ignore[assignment]

    def __call__(
        self, groups: list[torch.Tensor], settings: Settings | None = None
    ) -> list[torch.Tensor]:
        """Each sample's advantage; ``settings``: its settings (default: their defaults)."""
        return self.estimate(groups, self.settings_class() if settings is None else settings)

    @property
    def summary(self) -> str:
        """What it computes (the configuration reference lists it): the first paragraph
        of its function's docstring."""
        return first_paragraph(self.estimate.__doc__)


ESTIMATORS: Registry[AdvantageEstimator[Any]] = Registry(
    "advantage estimator", ADVANTAGE_VARIABLE, dotted_paths=True
)


def register_advantage(
    name: str,
    settings: type[Settings] = NoSettings,  # type: ignore[assignment]
) -> Callable[[Estimate[Settings]], Estimate[Settings]]:
    """Decorator: register the decorated function as the estimator ``name``."""

    def decorate(estimate: Estimate[Settings]) -> Estimate[Settings]:
        ESTIMATORS.add(name, AdvantageEstimator(estimate, settings))
        return estimate

    return decorate


def get_advantage_estimator(name: str) -> AdvantageEstimator[Any]:
    """The estimator registered as ``name``, or the :class:`AdvantageEstimator` at that
    dotted path."""
    estimator = ESTIMATORS.get(name)
    if not isinstance(estimator, AdvantageEstimator):
        raise TypeError(
            f"{ADVANTAGE_VARIABLE}={name!r} is not an AdvantageEstimator (sf_trainer.advantages)"
        )
    return estimator


def chosen_estimator(choice: PluginChoice) -> tuple[AdvantageEstimator[Any], PluginSettings]:
    """The estimator ``SF_TRAINER_ADVANTAGE`` / ``[trainer.advantage]`` chose, and its
    settings from the keys given there (an unknown key raises ValueError)."""
    estimator = get_advantage_estimator(choice.name)
    settings = settings_of(choice, estimator.settings_class, "advantage estimator",
                           ADVANTAGE_VARIABLE)  # fmt: skip
    return estimator, settings


def _population_std(values: torch.Tensor) -> torch.Tensor:
    # population std (unbiased=False): defined for one sample, and 0 when all are equal
    return values.std(unbiased=False)


@register_advantage("grpo")
def grpo_advantages(groups: list[torch.Tensor], settings: NoSettings) -> list[torch.Tensor]:
    """GRPO: ``(r - group mean) / (group std + 1e-6)``. A group of equal rewards gets 0
    everywhere: it carries no learning signal."""
    return [(r - r.mean()) / (_population_std(r) + STD_EPS) for r in groups]


@register_advantage("dr_grpo")
def dr_grpo_advantages(groups: list[torch.Tensor], settings: NoSettings) -> list[torch.Tensor]:
    """Dr. GRPO: ``r - group mean``. No division by the group's std, which up-weights
    groups that are nearly all right or all wrong (a difficulty bias)."""
    return [r - r.mean() for r in groups]


@register_advantage("rloo")
def rloo_advantages(groups: list[torch.Tensor], settings: NoSettings) -> list[torch.Tensor]:
    """RLOO: ``r_i - mean of the other samples of the group`` (leave-one-out baseline,
    independent of r_i, so the estimate is unbiased). A group of one sample has no
    baseline: its advantage is 0."""
    advantages = []
    for rewards in groups:
        others = rewards.numel() - 1
        if others == 0:
            advantages.append(torch.zeros_like(rewards))
        else:
            advantages.append(rewards - (rewards.sum() - rewards) / others)
    return advantages


@register_advantage("reinforce_pp")
def reinforce_pp_advantages(groups: list[torch.Tensor], settings: NoSettings) -> list[torch.Tensor]:
    """REINFORCE++ for outcome rewards: no group baseline; the rewards are normalised
    across the whole batch, ``(r - batch mean) / (batch std + 1e-6)``.

    Each sample counts once (the paper whitens per-token returns, which for an outcome
    reward counts a sample once per token: a long answer would move the baseline
    more). The paper's KL penalty in the reward is not applied here; use the loss's KL
    term (``SF_TRAINER_KL_COEF``) instead.
    """
    if not groups:
        return []
    rewards = torch.cat(groups)
    normalised = (rewards - rewards.mean()) / (_population_std(rewards) + STD_EPS)
    return list(normalised.split([g.numel() for g in groups]))


@register_advantage("reinforce_pp_baseline")
def reinforce_pp_baseline_advantages(
    groups: list[torch.Tensor], settings: NoSettings
) -> list[torch.Tensor]:
    """REINFORCE++ with baseline (the paper's variant for grouped samples):
    ``r - group mean``, divided by the std of those differences across the whole
    batch (+ 1e-6). Unlike GRPO, a group with little spread is not scaled up."""
    if not groups:
        return []
    centred = torch.cat([r - r.mean() for r in groups])
    normalised = centred / (_population_std(centred) + STD_EPS)
    return list(normalised.split([g.numel() for g in groups]))


def overlong_penalty(response_tokens: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment of a response of ``response_tokens`` tokens.

    0 up to ``max_tokens - cache_tokens``; then falling linearly to -1 at
    ``max_tokens``; -1 beyond. ``max_tokens`` 0 turns it off.
    """
    if max_tokens <= 0:
        return 0.0
    soft_limit = max_tokens - cache_tokens
    if response_tokens <= soft_limit:
        return 0.0
    if response_tokens <= max_tokens:
        # cache_tokens > 0 here: with 0 this interval is empty
        return (soft_limit - response_tokens) / cache_tokens
    return -1.0


def shaped_reward(sample: TrainSample, settings: TrainerSettings) -> float:
    """The sample's reward plus its overlong penalty. The response length is the
    sample's trained tokens: every token the policy generated, over all turns of a
    multi-turn session."""
    response_tokens = sum(sample.loss_mask)
    penalty = overlong_penalty(
        response_tokens, settings.overlong_max_tokens, settings.overlong_cache_tokens
    )
    return sample.reward + penalty


def batch_advantages(groups: list[SampleGroup], settings: TrainerSettings) -> list[float]:
    """Every sample's advantage from its shaped reward, in batch order (group by group).

    The estimator sees one reward per session: a session that gave several samples
    (turns the chat template rewrote, see ``sf_trajectory.grouping.trained_branches``)
    counts once in its group's statistics, and each of its samples gets the session's
    advantage; its reward is shaped over all its samples' trained tokens."""
    estimator, estimator_settings = chosen_estimator(settings.advantage)
    rewards: list[torch.Tensor] = []
    sessions: list[dict[str, list[TrainSample]]] = []
    for group in groups:
        per_session: dict[str, list[TrainSample]] = {}
        for sample in group.samples:
            per_session.setdefault(sample.session_id, []).append(sample)
        sessions.append(per_session)
        rewards.append(
            torch.tensor(
                [_session_reward(samples, settings) for samples in per_session.values()],
                dtype=torch.float32,
            )
        )
    result: list[float] = []
    for group, per_session, advantages in zip(
        groups, sessions, estimator(rewards, estimator_settings), strict=True
    ):
        of_session = dict(zip(per_session, advantages.tolist(), strict=True))
        result.extend(of_session[sample.session_id] for sample in group.samples)
    return result


def _session_reward(samples: list[TrainSample], settings: TrainerSettings) -> float:
    if len(samples) == 1:
        return shaped_reward(samples[0], settings)
    merged = msgspec.structs.replace(
        samples[0], loss_mask=[m for s in samples for m in s.loss_mask]
    )
    return shaped_reward(merged, settings)
