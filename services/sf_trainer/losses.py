"""Policy losses as small named plug-ins (``SF_TRAINER_LOSS``).

Every loss sees per-token tensors [batch, tokens]: ``logprobs`` under the policy being
trained (with grad), ``behaviour_logprobs`` recorded by the engine that generated the
token, ``advantages`` broadcast per sequence, and the loss ``mask``. The trainer takes
one optimizer step per batch, so the proximal policy of decoupled PPO (the policy at
the start of the step) is the current policy, detached.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sf_trainer.config import TrainerSettings
from sf_trainer.grpo import clipped_policy_loss


@dataclass
class LossOutput:
    loss: torch.Tensor
    clipped_tokens: float
    """Tokens whose ratio the PPO clip changed."""
    truncated_tokens: float
    """Tokens whose behaviour importance weight hit the cap."""


LossFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, TrainerSettings, float], LossOutput
]
_LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    def decorate(fn: LossFn) -> LossFn:
        _LOSSES[name] = fn
        return fn

    return decorate


def get_loss(name: str) -> LossFn:
    try:
        return _LOSSES[name]
    except KeyError:
        raise KeyError(f"unknown loss {name!r}; known: {sorted(_LOSSES)}") from None


@register_loss("grpo")
def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: TrainerSettings,
    normalizer: float,
) -> LossOutput:
    """GRPO's PPO-clip with the behaviour policy as the old policy: staleness and
    engine/trainer mismatch both count against the trust region."""
    loss, clipped = clipped_policy_loss(
        logprobs, behaviour_logprobs, advantages, mask, settings.clip_eps, normalizer
    )
    return LossOutput(loss=loss, clipped_tokens=float(clipped), truncated_tokens=0.0)


@register_loss("grpo_decoupled")
def decoupled_grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: TrainerSettings,
    normalizer: float,
) -> LossOutput:
    """Decoupled PPO (AReaL) with truncated importance sampling.

    The trust region is measured against the proximal policy (the policy at the start
    of this step); the gap between the proximal and the behaviour policy (stale weights,
    engine numerics) is corrected by the importance weight pi_prox / pi_behaviour,
    truncated at ``is_cap`` so one very off-policy token cannot dominate the step.
    """
    proximal = logprobs.detach()
    weight = torch.exp(proximal - behaviour_logprobs)
    truncated = weight > settings.is_cap
    weight = torch.clamp(weight, max=settings.is_cap)
    loss, clipped = clipped_policy_loss(
        logprobs, proximal, advantages, mask, settings.clip_eps, normalizer, token_weights=weight
    )
    return LossOutput(
        loss=loss,
        clipped_tokens=float(clipped),
        truncated_tokens=float((truncated.float() * mask).sum()),
    )
