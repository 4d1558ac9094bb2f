"""The math the GRPO family shares: token logprobs as the engines define them (from
whole logits, or from final hidden states chunk by chunk), and the PPO-clip surrogate.
Pure torch functions, tested against hand-computed numbers."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor
) -> torch.Tensor:
    """log p(target) under ``softmax(logits / temperature)``; the engines' definition.

    ``temperature`` is one for every token, or one per target (a tensor shaped like
    ``targets``: each row of logits is divided by its own). 0 = greedy, whose logprob
    is taken at temperature 1, as the engines report it.
    """
    # float32 at least: bf16 logits are upcast, float64 ones (tests) stay float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if isinstance(temperature, torch.Tensor):
        per_token = temperature.to(device=logits.device, dtype=logits.dtype)
        scale = torch.where(per_token > 0, per_token, 1.0).unsqueeze(-1)
        scaled = logits / scale
    else:
        scaled = logits / temperature if temperature > 0 else logits
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
) -> torch.Tensor:
    """``token_logprobs(hidden @ head_weight.T, targets, temperature)`` without ever
    holding more than ``chunk_tokens`` rows of logits.

    ``hidden``: final hidden states [..., H] (one per target); ``head_weight``: the output
    embedding [V, H] (for a tied model, the input embedding). Each chunk of tokens is
    projected, scaled and log-softmaxed on its own, and under autograd the chunk is
    checkpointed: the forward keeps only its inputs (views of ``hidden`` and the shared
    weight) and the backward recomputes the chunk's logits, so forward and backward both
    peak at O(chunk x V) instead of O(tokens x V). A single chunk (at most
    ``chunk_tokens`` rows) is not checkpointed: it keeps its own outputs for the
    backward, O(chunk x V) too, and saves the recomputation. Each logprob is the same row
    computation as the whole-logits one; only the gradient's sum over tokens is taken
    chunk by chunk (another float summation order).
    """
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    shape = targets.shape
    rows = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    flat_temperature: float | torch.Tensor = (
        temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else temperature
    )
    # One chunk is not checkpointed: its saved tensors are one chunk's, which is the bound
    # the checkpointing keeps, and the backward need not recompute its logits.
    recompute = (
        torch.is_grad_enabled()
        and (rows.requires_grad or head_weight.requires_grad)
        and rows.shape[0] > chunk_tokens
    )
    pieces = []
    for start in range(0, rows.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk_temperature = (
            flat_temperature[start:end]
            if isinstance(flat_temperature, torch.Tensor)
            else flat_temperature
        )
        arguments = (rows[start:end], head_weight, flat_targets[start:end], chunk_temperature)
        if recompute:
            pieces.append(checkpoint(_chunk_logprobs, *arguments, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*arguments))
    if not pieces:
        return torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    return torch.cat(pieces).reshape(shape)


def _chunk_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, head_weight)
    return token_logprobs(logits, targets, temperature)


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
