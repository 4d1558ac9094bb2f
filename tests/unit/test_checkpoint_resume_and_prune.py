"""Which checkpoint a trainer resumes from and which it prunes, from the files alone (no
model): ``resume = "latest"`` takes the most trained complete checkpoint, and pruning
keeps the newest periodic ones and the final. What a checkpoint holds and resuming from
it are tests/service/test_trainer_checkpoint.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from sf_trainer import checkpoint
from tests.support.checkpoint_files import write_checkpoint_files


def test_resume_latest_takes_the_most_trained_complete_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert checkpoint.resolve_resume("latest", tmp_path) is None  # first start: base model
    assert checkpoint.resolve_resume("", tmp_path) is None
    write_checkpoint_files(root / "step-2", 2)
    write_checkpoint_files(root / "step-4", 4)
    write_checkpoint_files(root / ".final.saving", 9)  # an interrupted save
    write_checkpoint_files(root / "step-6", 6, optimizer=False)  # written before optimizers
    assert checkpoint.resolve_resume("latest", tmp_path) == root / "step-4"
    assert checkpoint.resolve_resume(str(root / "step-2"), tmp_path) == root / "step-2"
    with pytest.raises(FileNotFoundError, match=r"optimizer\.pt"):
        checkpoint.resolve_resume(str(root / "step-6"), tmp_path)
    with pytest.raises(ValueError, match="SF_RUN_DIR"):
        checkpoint.resolve_resume("latest", None)


def test_pruning_keeps_the_newest_periodic_checkpoints_and_final(tmp_path: Path) -> None:
    for step in (1, 2, 10, 11):
        write_checkpoint_files(tmp_path / f"step-{step}", step)
    write_checkpoint_files(tmp_path / "final", 11)
    removed = checkpoint.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-1", "step-2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final", "step-10", "step-11"]
