"""Building transformers models in a process that may build several at once.

transformers (5.x) keeps a tied model's weights apart while ``from_pretrained`` fills
them by replacing the *class* method ``PreTrainedModel.tie_weights`` with a no-op for the
duration of the load, then putting back what it saved. Two loads in two threads of one
process interleave that save and restore: the later one can put the no-op back for good,
and from then on no model built in the process is tied (a tied model's output matrix is
a separate, untrained one; its checkpoints hold both). A model built from a config while
another thread loads is untied the same way. Services load in worker threads (the
engine, the trainer's policy and reference), and tests run several services in one
process, so every model this product builds goes through here, one at a time.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

_BUILDING = threading.Lock()
"""Held while transformers builds a model: its tying switch is process-wide state."""


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)``, tied as its
    config says (``TiedWeightsLost`` otherwise)."""
    from transformers import AutoModelForCausalLM

    with _BUILDING:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    check_tied(model)
    return model


def causal_lm_from_config(config: Any, dtype: torch.dtype) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config(config, dtype=dtype)``, tied as ``config`` says."""
    from transformers import AutoModelForCausalLM

    with _BUILDING:
        model: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype)
    check_tied(model)
    return model


class TiedWeightsLost(RuntimeError):
    """A model whose config ties its embeddings was built with two matrices."""


def check_tied(model: PreTrainedModel) -> None:
    text_config = model.config.get_text_config()
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    output = model.get_output_embeddings()
    if output is None or output.weight is model.get_input_embeddings().weight:
        return
    raise TiedWeightsLost(
        f"{type(model).__name__} ties its embeddings (tie_word_embeddings) but was built "
        "with a separate output matrix: transformers' tying was switched off in this "
        "process (a model loaded concurrently outside seamlessflow.assets.loading)"
    )


def readable_by_all(directory: Path) -> Path:
    """Give ``directory`` and every file in it read (and, for directories, search)
    permission for everyone, keeping the other bits. A model or checkpoint is read by
    other uids (a service in another container, a colleague's process), but safetensors
    writes its weights 0600 and ``mkdtemp`` makes 0700 directories."""
    for path in [directory, *Path(directory).rglob("*")]:
        extra = 0o555 if path.is_dir() else 0o444
        path.chmod(path.stat().st_mode | extra)
    return directory
