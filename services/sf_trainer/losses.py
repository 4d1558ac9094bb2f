"""Policy losses as small named plug-ins (``SF_TRAINER_LOSS``).

A loss has two parts, both explicit at its registration:

- its **terms**: a loss value per token [batch, tokens], from ``logprobs`` under the
  policy being trained (with grad), ``behaviour_logprobs`` recorded by the engine that
  generated each token, the per-sequence ``advantages`` [batch, 1] and the loss
  ``mask``. A sequence-level loss (GSPO) puts its sequence's value on each of the
  sequence's tokens;
- its **aggregation**: how the masked terms of a micro-batch become its share of the
  batch's scalar loss.

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
from typing import NamedTuple

import torch

from seamlessflow.plugins import Registry
from sf_trainer.grpo import ppo_clip
from sf_trainer.settings import TrainerSettings


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
    """[batch, tokens] bool: the behaviour importance weight hit ``SF_TRAINER_IS_CAP``."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    clipped_tokens: float
    """Trained tokens whose ratio the clip changed."""
    truncated_tokens: float
    """Trained tokens whose behaviour importance weight hit the cap."""
    kl_sum: float
    """k3 KL to the reference, summed over trained tokens (0 without a reference)."""


Terms = Callable[[LossInputs, TrainerSettings], PolicyTerms]
Aggregation = Callable[[torch.Tensor, torch.Tensor, BatchTotals, TrainerSettings], torch.Tensor]
"""(per-token values, mask, whole-batch totals, settings) -> this micro-batch's share."""


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference), k3 estimator: ``exp(d) - d - 1`` with
    ``d = ref - logp``. Never negative, 0 exactly where the two agree."""
    delta = reference_logprobs - logprobs
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True)
class PolicyLoss:
    terms: Terms
    aggregate: Aggregation

    def __call__(
        self, inputs: LossInputs, settings: TrainerSettings, totals: BatchTotals
    ) -> LossOutput:
        mask = inputs.mask
        terms = self.terms(inputs, settings)
        loss = self.aggregate(terms.per_token, mask, totals, settings)
        kl_sum = 0.0
        if inputs.reference_logprobs is not None:
            kl = kl_k3(inputs.logprobs, inputs.reference_logprobs)
            loss = loss + settings.kl_coef * self.aggregate(kl, mask, totals, settings)
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


LOSSES: Registry[PolicyLoss] = Registry("loss", "SF_TRAINER_LOSS")


def register_loss(name: str, aggregate: Aggregation) -> Callable[[Terms], Terms]:
    def decorate(terms: Terms) -> Terms:
        LOSSES.add(name, PolicyLoss(terms, aggregate))
        return terms

    return decorate


def get_loss(name: str) -> PolicyLoss:
    return LOSSES.get(name)


# aggregations ------------------------------------------------------------------------


def token_mean(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: TrainerSettings
) -> torch.Tensor:
    """Every trained token of the batch weighs the same: ``sum / batch tokens`` (DAPO's
    token-level loss; a long answer is not diluted by its own length)."""
    return (per_token * mask).sum() / totals.tokens


def token_sum_over_constant(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: TrainerSettings
) -> torch.Tensor:
    """Dr. GRPO: each sequence's token sum divided by a constant C, averaged over the
    batch's sequences: ``sum / (sequences x C)``. C is ``SF_TRAINER_DR_GRPO_TOKENS``
    (the generation budget, as in the paper), or the batch's longest response when 0:
    either way one number for the whole batch, so a token's weight depends neither on
    its sequence's length nor on how many tokens the batch has."""
    constant = settings.dr_grpo_tokens or totals.longest_response
    return (per_token * mask).sum() / (totals.sequences * constant)


def sequence_mean(
    per_token: torch.Tensor, mask: torch.Tensor, totals: BatchTotals, settings: TrainerSettings
) -> torch.Tensor:
    """Every sequence weighs the same: the token mean of each sequence, summed, divided
    by the batch's sequences. A sequence-level term (the same on all its tokens) is
    thus summed per sequence and divided by the number of sequences."""
    per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_sequence.sum() / totals.sequences


# losses ------------------------------------------------------------------------------


@register_loss("grpo", aggregate=token_mean)
def grpo_terms(inputs: LossInputs, settings: TrainerSettings) -> PolicyTerms:
    """GRPO's PPO-clip with the behaviour policy as the old policy, ratio within
    [1 - clip_eps, 1 + clip_eps]: staleness and engine/trainer mismatch both count
    against the trust region."""
    ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    per_token, clipped = ppo_clip(ratio, inputs.advantages, settings.clip_eps, settings.clip_eps)
    return PolicyTerms(per_token, clipped)


@register_loss("grpo_decoupled", aggregate=token_mean)
def decoupled_grpo_terms(inputs: LossInputs, settings: TrainerSettings) -> PolicyTerms:
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
register_loss("dr_grpo", aggregate=token_sum_over_constant)(grpo_terms)


@register_loss("dapo", aggregate=token_mean)
def dapo_terms(inputs: LossInputs, settings: TrainerSettings) -> PolicyTerms:
    """DAPO's clip-higher: PPO-clip against the behaviour logprobs with the ratio within
    [1 - clip_eps_low, 1 + clip_eps_high]. A higher upper bound lets an unlikely token
    with a positive advantage gain more probability before its gradient stops, against
    entropy collapse; the lower bound stays tight."""
    ratio = torch.exp(inputs.logprobs - inputs.behaviour_logprobs)
    per_token, clipped = ppo_clip(
        ratio, inputs.advantages, settings.clip_eps_low, settings.clip_eps_high
    )
    return PolicyTerms(per_token, clipped)


@register_loss("gspo", aggregate=sequence_mean)
def gspo_terms(inputs: LossInputs, settings: TrainerSettings) -> PolicyTerms:
    """GSPO: one importance ratio per sequence against the behaviour policy, the
    geometric mean of its token ratios, ``s = exp(mean over its trained tokens of
    (logp - behaviour))``, clipped per sequence within [1 - gspo_clip_eps_low,
    1 + gspo_clip_eps_high] (the paper's 3e-4 and 4e-4: a length-normalised ratio moves
    far less than a token's). A clipped sequence counts all its tokens as clipped."""
    mask = inputs.mask
    trained = mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_ratio = ((inputs.logprobs - inputs.behaviour_logprobs) * mask).sum(-1, keepdim=True)
    per_sequence, clipped = ppo_clip(
        torch.exp(log_ratio / trained),
        inputs.advantages,
        settings.gspo_clip_eps_low,
        settings.gspo_clip_eps_high,
    )
    shape = inputs.logprobs.shape
    return PolicyTerms(per_sequence.expand(shape), clipped.expand(shape))
