"""The math the GRPO family shares: token logprobs as the engines define them, and the
PPO-clip surrogate. Pure torch functions, tested against hand-computed numbers."""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log p(target) under ``softmax(logits / temperature)``; the engines' definition.

    ``temperature`` is one for every token, or one per target (a tensor shaped like
    ``targets``: each row of logits is divided by its own). 0 = greedy, whose logprob
    is taken at temperature 1, as the engines report it.
    """
    if isinstance(temperature, torch.Tensor):
        per_token = temperature.to(device=logits.device, dtype=torch.float32)
        scale = torch.where(per_token > 0, per_token, 1.0).unsqueeze(-1)
        scaled = logits.float() / scale
    else:
        scaled = logits.float() / temperature if temperature > 0 else logits.float()
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO-clip loss ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, element-wise.

    ``ratio`` and ``advantages`` broadcast (per token [B, T] with advantages [B, 1], or
    per sequence [B, 1]). Returns (loss, where the clip changed the ratio). The min
    takes the pessimistic side: a ratio beyond the bound in the direction the advantage
    pushes gets no gradient, one beyond it in the other direction keeps its gradient.
    """
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped), unclipped != clipped
