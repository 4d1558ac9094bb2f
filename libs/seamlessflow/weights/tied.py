"""Tied weights: one matrix registered under two names (a tied model's
``lm_head.weight`` is its ``model.embed_tokens.weight``, as in Qwen2.5-0.5B, Qwen3-0.6B,
Llama-3.2-1B).

Invariant: what leaves a trainer (a published version, a checkpoint) holds each
matrix once, under its first name, as ``save_pretrained`` writes a tied model: an alias
adds the matrix's bytes again (+27% for Qwen2.5-0.5B) and nothing else. Receivers take
either form (the engines tie by the model's own registration).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch

_V = TypeVar("_V")


def tied_aliases(named: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """{alias: first name} for entries that share one storage, in ``named``'s order
    (``model.state_dict(keep_vars=True)`` or ``named_parameters(remove_duplicate=False)``
    of an unsharded model); empty for an untied model. On the meta device, where no
    tensor has storage, a tied matrix is one object under two names."""
    first: dict[tuple[int, int], str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in named.items():
        if tensor.numel() == 0:
            continue
        if tensor.is_meta:
            key = (-1, id(tensor))
        else:
            key = (tensor.untyped_storage().data_ptr(), int(tensor.storage_offset()))
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def without_aliases(state: dict[str, _V], aliases: Mapping[str, str]) -> dict[str, _V]:
    """``state`` with each tied matrix under its first name only (in place; returned)."""
    for alias in aliases:
        state.pop(alias, None)
    return state


def with_aliases(state: dict[str, _V], aliases: Mapping[str, str]) -> dict[str, _V]:
    """``state`` with every alias present again (in place; returned): loaders that match
    a model's names one by one (torch's ``set_model_state_dict``) find both."""
    for alias, name in aliases.items():
        if alias not in state and name in state:
            state[alias] = state[name]
    return state
