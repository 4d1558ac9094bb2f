"""A trainer checkpoint's files without a model: its state (step, version, data
position) and, unless left out, an optimizer file, where ``sf_trainer.checkpoint``
looks for them; for the tests of resuming, pruning and replacing checkpoints."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from sf_trainer import checkpoint
from sf_trainer.checkpoint import TrainerState


def write_checkpoint_files(path: Path, step: int, optimizer: bool = True) -> None:
    path.mkdir(parents=True)
    state = TrainerState(step=step, version=step, data_position=step - 1)
    (path / checkpoint.STATE_FILE).write_bytes(msgspec.json.encode(state))
    if optimizer:
        torch.save({}, path / checkpoint.OPTIMIZER_FILE)
