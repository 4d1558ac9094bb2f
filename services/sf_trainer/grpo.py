"""GRPO: group-normalised advantages and the clipped, token-level policy loss.

Pure torch functions, tested against hand-computed numbers.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Advantage of each sample relative to its group: ``(r - mean) / (std + eps)``.

    ``rewards`` has shape [groups, samples]; std is the population std of the group
    (unbiased=False) so a group of identical rewards gets advantage 0 everywhere: it
    carries no learning signal.
    """
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p(target) under ``softmax(logits / temperature)``; the engines' definition."""
    scaled = logits.float() / temperature if temperature > 0 else logits.float()
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    normalizer: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip surrogate averaged over all unmasked tokens of the batch (token-level).

    All tensors are [batch, tokens] (advantages broadcast per sequence). Returns
    (loss, number of clipped tokens). ``normalizer`` is the batch's total token count
    when the batch is split into micro-batches, so the sum of micro-batch losses equals
    the full-batch loss. ``token_weights`` (no grad) scale each token's surrogate, e.g.
    importance weights correcting for the behaviour policy.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights
    mask = mask.to(per_token.dtype)
    total = normalizer if normalizer is not None else mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / total
    clipped_count = ((unclipped != clipped).to(mask.dtype) * mask).sum()
    return loss, clipped_count
