"""Policy losses as small named plug-ins (``SF_TRAINER_LOSS``), each with its own settings.

A loss has three parts, all explicit at its registration:

- its **terms**: a loss value per token [batch, tokens], from ``logprobs`` under the
  policy being trained (with grad), ``behaviour_logprobs`` recorded by the engine that
  generated each token, the per-sequence ``advantages`` [batch, 1] and the loss
  ``mask``. A sequence-level loss (GSPO) puts its sequence's value on each of the
  sequence's tokens;
- its **aggregation**: how the masked terms of a micro-batch become its share of the
  batch's scalar loss;
- its **settings**: a small pydantic model (``seamlessflow.plugin_settings``) of its
  hyperparameters, set in ``[trainer.loss]`` or as ``SF_TRAINER_LOSS__<KEY>``; the
  terms and the aggregation receive them.

``SF_TRAINER_LOSS`` names a registered loss or a ``package.module:attribute`` that is a
:class:`PolicyLoss` (e.g. ``PolicyLoss(my_terms, token_mean, MySettings)``).

Micro-batches and ranks: an aggregation divides by whole-batch quantities
(:class:`BatchTotals`, the same on every rank), never by a micro-batch's own counts, so
the micro-batch losses of every pass on every rank sum to the whole batch's loss. A
sample is never split across micro-batches, so a per-sequence quantity (GSPO's ratio, a
sequence's token mean) is always computed whole.

The KL to the reference model (``SF_TRAINER_KL_COEF`` > 0) is added per token (the k3
estimator) and aggregated like the loss's own terms.

The trainer takes one optimizer step per batch, so the proximal policy of decoupled PPO
(the policy at the start of the step) is the current policy, detached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple

import torch
from pydantic import Field

from seamlessflow.plugin_settings import NoSettings, PluginChoice, Settings, settings_of
from seamlessflow.plugin_settings import PluginSettings as LossSettings
from seamlessflow.plugins import Registry, first_paragraph
from sf_trainer.grpo import ppo_clip

LOSS_VARIABLE = "SF_TRAINER_LOSS"


@dataclass(frozen=True)
class BatchTotals:
    """Whole-batch counts the aggregations divide by (each at least 1)."""

    tokens: int
    """Trained tokens (loss mask 1)."""
    sequences: int
    """Samples with at least one trained token (the others add nothing to any loss)."""
    longest_response: int
    """Most trained tokens of one sample."""

    @classmethod
    def of(cls, loss_masks: Iterable[Sequence[int]]) -> BatchTotals:
        trained = [sum(mask) for mask in loss_masks]
        return cls(
            tokens=max(sum(trained), 1),
            sequences=max(sum(1 for n in trained if n > 0), 1),
            longest_response=max(trained, default=1) or 1,
        )


@dataclass
class LossInputs:
    """One micro-batch: per-token tensors [batch, tokens], advantages [batch, 1]."""

    logprobs: torch.Tensor
    behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    """1.0 where a token is trained, else 0.0."""
    reference_logprobs: torch.Tensor | None = None
    """Under the frozen reference model (no grad); None: no KL term."""


class PolicyTerms(NamedTuple):
    per_token: torch.Tensor
    """[batch, tokens] loss terms, with grad."""
    clipped: torch.Tensor
    """[batch, tokens] bool: the clip changed this token's (or its sequence's) ratio."""
    truncated: torch.Tensor | None = None
    """[batch, tokens] bool: the behaviour importance weight hit ``grpo_decoupled``'s
    ``is_cap``."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    clipped_tokens: float
    """Trained tokens whose ratio the clip changed."""
    truncated_tokens: float
    """Trained tokens whose behaviour importance weight hit the cap."""
    kl_sum: float
    """k3 KL to the reference, summed over trained tokens (0 without a reference)."""


Terms = Callable[[LossInputs, Settings], PolicyTerms]
Aggregation = Callable[[torch.Tensor, torch.Tensor, BatchTotals, Settings], torch.Tensor]
"""(per-token values, mask, whole-batch totals, the loss's settings) -> this
micro-batch's share."""


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), k3 estimator: ``exp(d) - d - 1`` with
    ``d = ref - logp``. Never negative, 0 exactly where the two agree."""
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class PolicyLoss(Generic[Settings]):
    """A loss: its terms and aggregation, both given its ``settings_class``'s values."""

    terms: Terms[Settings]
    aggregate: Aggregation[Settings]
    settings_class: type[Settings] = NoSettings  # type: ignore[assignment]

    def settings(self, **values: Any) -> Settings:
        """Its settings: the defaults, with ``values`` (checked) instead."""
        return self.settings_class.model_validate(values)

    @property
    def summary(self) -> str:
        """What it computes (the configuration reference lists it): its terms', then its
        aggregation's docstring, first paragraph each (``dr_grpo`` is ``grpo``'s terms
        with another aggregation)."""
        parts = (first_paragraph(self.terms.__doc__), first_paragraph(self.aggregate.__doc__))
        return " ".join(part for part in parts if part)

    def __call__(
        self, inputs: LossInputs, settings: Settings, totals: BatchTotals, kl_coef: float = 0.0
    ) -> LossOutput:
        """This micro-batch's loss; with ``reference_logprobs``, plus ``kl_coef`` x the
        k3 KL, aggregated like the terms."""
        mask = inputs.mask
        terms = self.terms(inputs, settings)
        loss = self.aggregate(terms.per_token, mask, totals, settings)
        kl_sum = 0.0
        if inputs.reference_logprobs is not None:
            kl = kl_k3(inputs.logprobs, inputs.reference_logprobs)
            loss = loss + kl_coef * self.aggregate(kl, mask, totals, settings)
            kl_sum = float((kl.detach() * mask).sum())
        truncated = terms.truncated
        return LossOutput(
            loss=loss,
            clipped_tokens=_trained_count(terms.clipped, mask),
            truncated_tokens=0.0 if truncated is None else _trained_count(truncated, mask),
            kl_sum=kl_sum,
        )


def _trained_count(flags: torch.Tensor, mask: torch.Tensor) -> float:
    return float((flags.to(mask.dtype) * mask).sum())


LOSSES: Registry[PolicyLoss[Any]] = Registry("loss", LOSS_VARIABLE, dotted_paths=True)


def register_loss(
    name: str, aggregate: Aggregation[Settings], settings: type[Settings]
) -> Callable[[Terms[Settings]], Terms[Settings]]:
    """Decorator: register the decorated terms as the loss ``name``."""

    def decorate(terms: Terms[Settings]) -> Terms[Settings]:
        LOSSES.add(name, PolicyLoss(terms, aggregate, settings))
        return terms

    return decorate


def get_loss(name: str) -> PolicyLoss[Any]:
    """The loss registered as ``name``, or the :class:`PolicyLoss` at that dotted path."""
    loss = LOSSES.get(name)
    if not isinstance(loss, PolicyLoss):
        raise TypeError(f"{LOSS_VARIABLE}={name!r} is not a PolicyLoss (sf_trainer.losses)")
    return loss


def chosen_loss(choice: PluginChoice) -> tuple[PolicyLoss[Any], LossSettings]:
    """The loss ``SF_TRAINER_LOSS`` / ``[trainer.loss]`` chose, and its settings from the
    keys given there (an unknown key raises ValueError naming the loss's keys)."""
    loss = get_loss(choice.name)
    return loss, settings_of(choice, loss.settings_class, "loss", LOSS_VARIABLE)


# settings ----------------------------------------------------------------------------


class PpoClipSettings(LossSettings):
    """``grpo``."""

    clip_eps: float = 0.2
    """PPO ratio clip: the ratio is kept within [1 - clip_eps, 1 + clip_eps]."""


class DecoupledSettings(PpoClipSettings):
    """``grpo_decoupled``."""

    is_cap: float = 2.0
    """Truncation of the behaviour importance weight pi_prox / pi_behaviour."""


class DrGrpoSettings(PpoClipSettings):
    """``dr_grpo``."""

    constant_tokens: int = Field(default=0, ge=0)
    """The constant C each sequence's token sum is divided by (then by the number of
    sequences); the paper uses the generation budget (max tokens). 0 = the batch's
    longest response in trained tokens."""


class ClipHigherSettings(LossSettings):
    """``dapo``."""

    clip_eps_low: float = 0.2
    """Lower ratio clip, 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """Upper ratio clip (clip-higher), 1 + clip_eps_high."""


class GspoSettings(LossSettings):
    """``gspo``: the GSPO paper's clip of the sequence ratio."""

    clip_eps_low: float = 3e-4
    """Lower clip of the sequence ratio, 1 - clip_eps_low."""
    clip_eps_high: float = 4e-4
    """Upper clip of the sequence ratio, 1 + clip_eps_high."""


# aggregations ------------------------------------------------------------------------


def token_mean(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: LossSettings
) -> torch.Tensor:
    """Every trained token of the batch weighs the same: ``sum / batch tokens`` (DAPO's
    token-level loss; a long answer is not diluted by its own length)."""
    return (per_token * mask).sum() / totals.tokens


def token_sum_over_constant(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: DrGrpoSettings
) -> torch.Tensor:
    """Dr. GRPO: each sequence's token sum divided by a constant C, averaged over the
    batch's sequences: ``sum / (sequences x C)``.

    C is ``constant_tokens`` (the generation budget, as in the paper), or the batch's
    longest response when 0: either way one number for the whole batch, so a token's
    weight depends neither on its sequence's length nor on how many tokens the batch
    has."""
    constant = settings.constant_tokens or totals.longest_response
    return (per_token * mask).sum() / (totals.sequences * constant)


def sequence_mean(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: LossSettings
) -> torch.Tensor:
    """Every sequence weighs the same: the token mean of each sequence, summed, divided
    by the batch's sequences.

    A sequence-level term (the same on all its tokens) is thus summed per sequence and
    divided by the number of sequences."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / totals.sequences


# losses ------------------------------------------------------------------------------


@register_loss("grpo", aggregate=token_mean, settings=PpoClipSettings)
def grpo_terms(inputs: LossInputs, settings: PpoClipSettings) -> PolicyTerms:
    """GRPO's PPO-clip with the behaviour policy as the old policy, ratio within
    [1 - clip_eps, 1 + clip_eps]: staleness and engine/trainer mismatch both count
    against the trust region."""
    ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    per_token, clipped = ppo_clip(ratio, inputs.advantages, settings.clip_eps, settings.clip_eps)
    return PolicyTerms(per_token, clipped)


@register_loss("grpo_decoupled", aggregate=token_mean, settings=DecoupledSettings)
def decoupled_grpo_terms(inputs: LossInputs, settings: DecoupledSettings) -> PolicyTerms:
    """Decoupled PPO (AReaL) with truncated importance sampling.

    The trust region is measured against the proximal policy (the policy at the start
    of this step); the gap between the proximal and the behaviour policy (stale weights,
    engine numerics) is corrected by the importance weight pi_prox / pi_behaviour,
    truncated at ``is_cap`` so one very off-policy token cannot dominate the step.
    """
    proximal = inputs.logprobs.detach()
    weight = torch.exp(proximal - inputs.behaviour_logprobs)
    ratio = torch.exp(inputs.logprobs - proximal)
    per_token, clipped = ppo_clip(ratio, inputs.advantages, settings.clip_eps, settings.clip_eps)
    weighted = per_token * torch.clamp(weight, max=settings.is_cap)
    return PolicyTerms(weighted, clipped, truncated=weight > settings.is_cap)


# Dr. GRPO changes GRPO's aggregation only (its advantage is the ``dr_grpo`` estimator)
register_loss("dr_grpo", aggregate=token_sum_over_constant, settings=DrGrpoSettings)(grpo_terms)


@register_loss("dapo", aggregate=token_mean, settings=ClipHigherSettings)
def dapo_terms(inputs: LossInputs, settings: ClipHigherSettings) -> PolicyTerms:
    """DAPO's clip-higher: PPO-clip against the behaviour logprobs with the ratio within
    [1 - clip_eps_low, 1 + clip_eps_high]. A higher upper bound lets an unlikely token
    with a positive advantage gain more probability before its gradient stops, against
    entropy collapse; the lower bound stays tight."""
    ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    per_token, clipped = ppo_clip(
        ratio, inputs.advantages, settings.clip_eps_low, settings.clip_eps_high
    )
    return PolicyTerms(per_token, clipped)


@register_loss("gspo", aggregate=sequence_mean, settings=GspoSettings)
def gspo_terms(inputs: LossInputs, settings: GspoSettings) -> PolicyTerms:
    """GSPO: one importance ratio per sequence against the behaviour policy, the
    geometric mean of its token ratios, ``s = exp(mean over its trained tokens of
    (logp - behaviour))``, clipped per sequence within [1 - clip_eps_low,
    1 + clip_eps_high] (the paper's 3e-4 and 4e-4: a length-normalised ratio moves
    far less than a token's). A clipped sequence counts all its tokens as clipped."""
    mask = inputs.mask
    trained = mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_ratio = ((inputs.logprobs - inputs.behaviour_logprobs) * mask).sum(-1, keepdim=True)
    per_sequence, clipped = ppo_clip(
        torch.exp(log_ratio / trained),
        inputs.advantages,
        settings.clip_eps_low,
        settings.clip_eps_high,
    )
    shape = inputs.logprobs.shape
    return PolicyTerms(per_sequence.expand(shape), clipped.expand(shape))
