"""The math the GRPO family shares: token logprobs as the engines define them (from
whole logits, or from final hidden states chunk by chunk), optionally with the entropy
of each token's distribution (a metric), and the PPO-clip surrogate. Pure torch
functions, tested against hand-computed numbers."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

ENTROPY_ROWS = 128
"""Distributions turned into entropies at a time (:func:`row_entropy`): its two no-grad
temporaries are [ENTROPY_ROWS, vocab] floats, together a quarter of the log-softmax of a
default logprob chunk (``SF_TRAINER_LOGPROB_CHUNK_TOKENS`` = 1024 rows), whatever the
number of rows."""


def token_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(target) under ``softmax(logits / temperature)``; the engines' definition.

    ``temperature`` is one for every token, or one per target (a tensor shaped like
    ``targets``: each row of logits is divided by its own). 0 = greedy, whose logprob
    is taken at temperature 1, as the engines report it.

    ``entropy``: if given, the entropy (nats) of each row's distribution, the same
    ``softmax(logits / temperature)`` (at temperature 1 for a greedy row, like its
    logprob), is appended to it, shaped like ``targets``, without grad. It is read off
    the log-softmax the logprobs are gathered from (:func:`row_entropy`), so the
    logprobs, and their gradient, are exactly those computed without it.
    """
    # float32 at least: bf16 logits are upcast, float64 ones (tests) stay float64
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if isinstance(temperature, torch.Tensor):
        per_token = temperature.to(device=logits.device, dtype=logits.dtype)
        scale = torch.where(per_token > 0, per_token, 1.0).unsqueeze(-1)
        scaled = logits / scale
    else:
        scaled = logits / temperature if temperature > 0 else logits
    log_probs = torch.log_softmax(scaled, dim=-1)
    if entropy is not None:
        entropy.append(row_entropy(log_probs))
    return log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def row_entropy(log_probs: torch.Tensor, rows: int = ENTROPY_ROWS) -> torch.Tensor:
    """``-sum_v p_v log p_v`` of each distribution along the last dimension, given as
    log-probabilities (a log-softmax); shaped like ``log_probs`` without that dimension,
    without grad. ``rows`` distributions at a time, so the temporaries (``p``, made ``p
    log p`` in place, and the clamped log-probabilities) are [rows, vocab] floats, never
    [tokens, vocab]. A token of probability 0 adds 0, a -inf logit's too (its
    log-probability is clamped to the lowest float: 0 x that is 0, where 0 x -inf would
    be NaN); a NaN row stays NaN."""
    vocab = log_probs.shape[-1]
    flat = log_probs.detach().reshape(-1, vocab)  # a view: a log-softmax is contiguous
    out = flat.new_empty(flat.shape[0])
    lowest = torch.finfo(flat.dtype).min
    with torch.no_grad():
        for start in range(0, flat.shape[0], rows):
            part = flat[start : start + rows]
            # the log-probabilities as they are, not log(p): one transcendental, not two
            terms = part.exp().mul_(part.clamp(min=lowest))
            out[start : start + rows] = terms.sum(-1).neg_()
    return out.reshape(log_probs.shape[:-1])


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    chunk_tokens: int,
    entropy: list[torch.Tensor] | None = None,
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

    ``entropy``: as in :func:`token_logprobs` (appended once, shaped like ``targets``),
    taken from each chunk's log-softmax while the chunk's logits exist, in the forward
    only: the backward's recomputation of a checkpointed chunk does not take it again.
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
    # one list per chunk, filled by the chunk's first run (_chunk_logprobs)
    entropies: list[list[torch.Tensor]] = []
    for start in range(0, rows.shape[0], chunk_tokens):
        end = start + chunk_tokens
        chunk_temperature = (
            flat_temperature[start:end]
            if isinstance(flat_temperature, torch.Tensor)
            else flat_temperature
        )
        chunk_entropy: list[torch.Tensor] | None = None
        if entropy is not None:
            chunk_entropy = []
            entropies.append(chunk_entropy)
        arguments = (
            rows[start:end],
            head_weight,
            flat_targets[start:end],
            chunk_temperature,
            chunk_entropy,
        )
        if recompute:
            pieces.append(checkpoint(_chunk_logprobs, *arguments, use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(*arguments))
    if not pieces:
        if entropy is not None:
            entropy.append(torch.zeros(shape, dtype=torch.float32, device=hidden.device))
        return torch.zeros(shape, dtype=torch.float32, device=hidden.device)
    if entropy is not None:
        entropy.append(torch.cat([chunk[0] for chunk in entropies]).reshape(shape))
    return torch.cat(pieces).reshape(shape)


def _chunk_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """One chunk's logprobs; its entropies into ``entropy`` if it is still empty (the
    first run: a checkpointed chunk runs again in the backward, whose autograd records
    the same operations either way, the entropy's being no-grad)."""
    logits = torch.nn.functional.linear(hidden, head_weight)
    first_run = entropy is not None and not entropy
    return token_logprobs(logits, targets, temperature, entropy if first_run else None)


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
