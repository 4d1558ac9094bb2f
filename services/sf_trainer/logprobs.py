"""The targets' logprobs under a causal LM, without a [tokens, vocab] tensor when the
model's head allows it (``SF_TRAINER_LOGPROB_CHUNK_TOKENS``).

The whole-logits path runs the model and log-softmaxes its logits: its forward keeps
tokens x vocab floats several times over (the logits, their float32 copy, the
log-softmax), about 10 GB per tensor for a 16k-token micro-batch at a 152k vocabulary.
The chunked path runs the same model with ``logits_to_keep`` set to no position (the
head projects nothing), takes the decoder's final hidden states from a forward hook,
and projects them through the output embedding chunk by chunk
(``sf_trainer.grpo.chunked_token_logprobs``).

That is the model's own head only where the head is exactly ``lm_head(final hidden
states)``: the families in :data:`PLAIN_HEAD_MODEL_TYPES`, whose ``*ForCausalLM.forward``
applies the linear head and nothing else (no final logit soft-capping as in Gemma 2, no
logit scale as in Cohere or Granite). Any other model type gets the whole-logits path
(:func:`chunked_head_refusal` says why).

Under FSDP2 the root module (embeddings, final norm, head) does not reshard after its
forward, so right after the full model's forward the output embedding is the unsharded
(all-gathered, in the policy's compute dtype) parameter, and its gradient from the
chunks is reduce-scattered with the root's other gradients at the end of the backward.
With the embeddings split by vocabulary rows (``SF_TRAINER_VOCAB_PARALLEL``, several
ranks) nothing is gathered: the ranks exchange hidden states and each projects onto its
own rows (``sf_trainer.vocab_parallel``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from sf_trainer.grpo import chunked_token_logprobs, token_logprobs
from sf_trainer.vocab_parallel import split_of, vocab_parallel_logprobs

PLAIN_HEAD_MODEL_TYPES = frozenset({"gemma3_text", "llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` of the families whose logits are ``lm_head(final hidden
states)`` exactly (read in transformers' modeling files; Gemma 3 soft-caps only where its
config sets ``final_logit_softcapping``, which :func:`chunked_head_refusal` checks)."""


RowLogprobs = Callable[
    [torch.Tensor, torch.Tensor, float | torch.Tensor, list[torch.Tensor] | None],
    torch.Tensor,
]
"""log p(target) of each row (logits or final hidden states, a row per target), at its
temperature, appending the rows' entropies to the list when one is given."""


def chunked_head_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s logits cannot be computed chunk by chunk from its hidden states
    (``None``: they can)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PLAIN_HEAD_MODEL_TYPES:
        return (
            f"model type {model_type!r} is not one whose logits are known to be the output "
            f"embedding of the final hidden states ({', '.join(sorted(PLAIN_HEAD_MODEL_TYPES))})"
        )
    for attribute in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(config, attribute, None) not in (None, 1, 1.0):
            return f"its config sets {attribute}: the head is more than the output embedding"
    if model.get_output_embeddings() is None:  # type: ignore[operator]
        return "it has no output embedding"
    return None


def target_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    temperatures: float | torch.Tensor,
    chunk_tokens: int,
    precision: Callable[[], AbstractContextManager[object]],
    needed: torch.Tensor | None = None,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """log p(targets[:, t]) at position t (``targets`` = ``input_ids[:, 1:]``), each at
    its temperature, float32 (at least). ``chunk_tokens`` > 0 and a plain head: chunk
    by chunk from the final hidden states; else from the whole logits. ``precision``:
    makes the context the forward and the head's projection run in
    (``sf_trainer.distributed.forward_precision``).

    ``needed`` (bool, shaped like ``targets``): the positions whose logprobs are used
    (the trained ones); only they go through the head and the log-softmax, the others
    are 0. In RL batches most positions are prompt, so this skips most of the head's
    work. Each needed logprob is the same row computation as without ``needed``. No
    needed position at all (a padding pass) computes every position, so the loss still
    depends on every parameter (every rank's backward reduces every gradient).

    ``entropy``: if given, the entropy (nats) of the next-token distribution at each
    position, at its temperature, is appended to it, shaped like ``targets``, float32 (at
    least), without grad; 0 where the logprob is (outside ``needed``). It comes from the
    log-softmax the logprobs are taken from (``sf_trainer.grpo.token_logprobs``): the
    logprobs and their gradient are unchanged, and the extra memory is two temporaries
    of ``sf_trainer.grpo.ENTROPY_ROWS`` x vocab floats."""
    selected: torch.Tensor | None = None
    if needed is not None:
        selected = needed.reshape(-1).nonzero().squeeze(-1)
        if selected.numel() == 0:
            selected = None
    if chunk_tokens <= 0 or chunked_head_refusal(model) is not None:
        with precision():
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # float32 from here (token_logprobs upcasts): bf16 logits, float32 log-softmax
        return _at_positions(
            token_logprobs, logits[:, :-1], targets, temperatures, selected, entropy
        )
    captured: list[torch.Tensor] = []

    def keep_hidden(_module: torch.nn.Module, _args: Any, output: Any) -> None:
        captured.append(output.last_hidden_state)

    decoder = model.get_decoder()  # type: ignore[operator]
    handle = decoder.register_forward_hook(keep_hidden)
    try:
        with precision():
            # the full model (so FSDP2's root gathers the head) projecting no position
            model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=torch.empty(0, dtype=torch.long, device=input_ids.device),
            )
    finally:
        handle.remove()
    (hidden,) = captured
    head = model.get_output_embeddings()  # type: ignore[operator]
    split = split_of(head)
    if split is not None:
        # every rank's rows meet this rank's vocabulary rows (sf_trainer.vocab_parallel)
        def split_head(
            rows: torch.Tensor,
            row_targets: torch.Tensor,
            row_temperatures: float | torch.Tensor,
            row_entropy: list[torch.Tensor] | None,
        ) -> torch.Tensor:
            return vocab_parallel_logprobs(
                rows.reshape(-1, rows.shape[-1]),
                head.weight,
                split,
                row_targets.reshape(-1),
                _flat(row_temperatures),
                chunk_tokens,
                row_entropy,
            ).reshape(row_targets.shape)

        per_row: RowLogprobs = split_head
    else:

        def whole_head(
            rows: torch.Tensor,
            row_targets: torch.Tensor,
            row_temperatures: float | torch.Tensor,
            row_entropy: list[torch.Tensor] | None,
        ) -> torch.Tensor:
            return chunked_token_logprobs(
                rows, head.weight, row_targets, row_temperatures, chunk_tokens, row_entropy
            )

        per_row = whole_head
    with precision():
        return _at_positions(per_row, hidden[:, :-1], targets, temperatures, selected, entropy)


def _at_positions(
    per_row: RowLogprobs,
    rows: torch.Tensor,
    targets: torch.Tensor,
    temperatures: float | torch.Tensor,
    selected: torch.Tensor | None,
    entropy: list[torch.Tensor] | None,
) -> torch.Tensor:
    """``per_row`` at the flat positions ``selected`` of ``rows`` [..., width] (None:
    every position, without flattening), shaped like ``targets``, 0 elsewhere; the
    entropies likewise into ``entropy``."""
    if selected is None:
        return per_row(rows, targets, temperatures, entropy)
    picked_entropy: list[torch.Tensor] | None = None if entropy is None else []
    picked = per_row(
        rows.reshape(-1, rows.shape[-1])[selected],
        targets.reshape(-1)[selected],
        _pick(temperatures, selected),
        picked_entropy,
    )
    if entropy is not None and picked_entropy is not None:
        entropy.append(_scatter(picked_entropy[0], selected, targets.shape))
    return _scatter(picked, selected, targets.shape)


def _flat(temperatures: float | torch.Tensor) -> float | torch.Tensor:
    return temperatures.reshape(-1) if isinstance(temperatures, torch.Tensor) else temperatures


def _pick(temperatures: float | torch.Tensor, selected: torch.Tensor) -> float | torch.Tensor:
    if isinstance(temperatures, torch.Tensor):
        return temperatures.reshape(-1)[selected]
    return temperatures


def _scatter(picked: torch.Tensor, selected: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``picked`` at the flat positions ``selected`` of a zero tensor shaped ``shape``."""
    whole = picked.new_zeros(shape.numel())
    return whole.index_put((selected,), picked).reshape(shape)
