"""Trainer checkpoints: the policy in HF layout, the optimizer, and where training stood.

A checkpoint is one directory (``<run_dir>/checkpoints/step-<n>`` or ``final``; a policy
other than the default one keeps its own under ``<run_dir>/checkpoints/<policy>/``):
- ``config.json``, ``generation_config.json``, ``model*.safetensors`` and the tokenizer:
  HF layout, loadable with ``from_pretrained``;
- ``optimizer.pt``: the full optimizer state in torch.distributed.checkpoint's
  ``full_state_dict`` form, gathered on rank 0. It is keyed by parameter *name*, so a
  checkpoint saved by N ranks resumes on any number of ranks (1 included). The price:
  rank 0 holds the whole optimizer state (AdamW: twice the fp32 weights) in CPU memory
  while saving and loading; past one host's memory, sharded torch.distributed.checkpoint
  files (each rank writes its shard) are the way on;
- ``trainer_state.json`` (:class:`TrainerState`): step, version and data position.

Files are written into a hidden sibling directory that is then renamed into place, with
``trainer_state.json`` written last: a crash while saving never leaves a half-written
checkpoint under a checkpoint's name. ``SF_TRAINER_KEEP_CHECKPOINTS`` bounds how many
``step-<n>`` checkpoints stay (``prune``).

A save never replaces a checkpoint whose weights hold more optimizer steps
(``TrainerState.trained_steps``) than the policy being saved (``FewerTrainedSteps``):
whatever restarts a trainer (a restart policy after it finished, a restart without
``SF_TRAINER_RESUME``, a resume from an older checkpoint), the most trained policy
under a name stays.

What a resume loses: the optimizer steps taken after the checkpoint it starts from.
The resumed policy never learns from their batches; the trainer continues after the
last step recorded in the metrics stream (step count and data position, see
``sf_trainer.service``), and its weight versions stay announced, so the resumed trainer
numbers its versions after the newest one. Nothing is trained twice: a redelivered
batch at or before the data position is acked untrained.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import msgspec
import torch
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedModel

from seamlessflow.assets.loading import readable_by_all
from seamlessflow.protocol import DEFAULT_POLICY
from seamlessflow.settings import checkpoints_dir

STATE_FILE = "trainer_state.json"
OPTIMIZER_FILE = "optimizer.pt"
LATEST = "latest"
log = logging.getLogger(__name__)


class TrainerState(msgspec.Struct, frozen=True, kw_only=True):
    """Where training stood when a checkpoint was taken."""

    step: int
    """Steps taken: batches trained, including those a resume lost before it."""
    version: int
    """The weight version this policy was published as."""
    data_position: int
    """``batch_index`` of the last trained TrainBatch (-1: none yet)."""
    trained_steps: int | None = None
    """Optimizer steps these weights hold, counted from the base model: ``step`` less
    the steps resumes lost. None: written before this field existed (``step`` stands
    in, the most it can hold)."""

    @property
    def trained(self) -> int:
        """Optimizer steps the saved weights hold."""
        return self.step if self.trained_steps is None else self.trained_steps


class FewerTrainedSteps(RuntimeError):
    """A save would replace a checkpoint that holds more trained steps."""


def save(
    out: Path,
    model: PreTrainedModel,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    state: TrainerState,
    tokenizer_dir: Path,
) -> Path:
    """Write a checkpoint of full (gathered) states to ``out``, replacing any there.

    ``model`` gives the config to write next to the weights (its own tensors may be
    shards; ``model_state`` is what is saved). Raises ``FewerTrainedSteps`` (and writes
    nothing) if the checkpoint at ``out`` holds more trained steps than ``state``.
    """
    check_replaceable(out, state)
    staging = out.parent / f".{out.name}.saving"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.config.save_pretrained(staging)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(staging)
    save_torch_state_dict(model_state, staging)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(staging)
    torch.save(optimizer_state, staging / OPTIMIZER_FILE)
    (staging / STATE_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(state)))
    readable_by_all(staging)  # another uid (a container, an evaluation job) reads it
    _replace(out, staging)
    log.info("checkpoint %s: step %d (%d trained), version %d, data position %d",
             out, state.step, state.trained, state.version, state.data_position)  # fmt: skip
    return out


def check_replaceable(out: Path, state: TrainerState) -> None:
    """Raise ``FewerTrainedSteps`` if ``out`` holds a checkpoint with more trained steps
    than ``state`` (an unreadable or half-written one counts as none)."""
    try:
        held = read_state(out)
    except (OSError, msgspec.DecodeError):
        return
    if held.trained > state.trained:
        raise FewerTrainedSteps(
            f"{out} holds {held.trained} trained steps (step {held.step}, version "
            f"{held.version}); this policy holds {state.trained}: kept, not replaced"
        )


def _replace(out: Path, staging: Path) -> None:
    previous = out.parent / f".{out.name}.previous"
    shutil.rmtree(previous, ignore_errors=True)
    if out.exists():
        out.rename(previous)
    staging.rename(out)
    shutil.rmtree(previous, ignore_errors=True)


def read_state(path: Path) -> TrainerState:
    return msgspec.json.decode((path / STATE_FILE).read_bytes(), type=TrainerState)


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files (one file or shards)."""
    state: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(file))
    return state


def load_optimizer_state(path: Path) -> dict[str, Any]:
    state: dict[str, Any] = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
    return state


def prune(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest ``keep`` periodic checkpoints (``step-<n>``) under
    ``root``; ``final`` and anything else stay. Returns what was removed."""
    periodic = [
        path
        for path in root.glob("step-*")
        if path.is_dir() and path.name.removeprefix("step-").isdigit()
    ]
    periodic.sort(key=lambda path: int(path.name.removeprefix("step-")))
    removed = periodic[: max(len(periodic) - keep, 0)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def latest(root: Path) -> Path | None:
    """The checkpoint under ``root`` whose weights hold the most trained steps (then
    the most steps, then the newest)."""
    candidates = [
        state_file.parent
        for state_file in root.glob(f"*/{STATE_FILE}")
        if not state_file.parent.name.startswith(".")
        and (state_file.parent / OPTIMIZER_FILE).is_file()
    ]
    if not candidates:
        return None

    def rank(path: Path) -> tuple[int, int, float]:
        state = read_state(path)
        return state.trained, state.step, (path / STATE_FILE).stat().st_mtime

    return max(candidates, key=rank)


def resolve_resume(resume: str, run_dir: Path | None, policy: str = DEFAULT_POLICY) -> Path | None:
    """The checkpoint ``SF_TRAINER_RESUME`` names; None = start from the base model."""
    if not resume:
        return None
    if resume == LATEST:
        if run_dir is None:
            raise ValueError(f"SF_TRAINER_RESUME={LATEST} needs SF_RUN_DIR")
        return latest(checkpoints_dir(run_dir, policy))
    path = Path(resume)
    for name in (STATE_FILE, OPTIMIZER_FILE):
        if not (path / name).is_file():
            raise FileNotFoundError(f"SF_TRAINER_RESUME={resume}: no {name} in {path}")
    return path
