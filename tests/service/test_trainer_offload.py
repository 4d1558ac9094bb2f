"""The trainer's offload while its slots are lent (``SF_TRAINER_OFFLOAD_WHEN_LENT``):
every rank's parameters and AdamW state leave the device and come back, accounted, and
training goes on exactly as without it, on one process and on two FSDP2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from sf_trainer.checkpoint import load_model_state
from tests.support.ranks import BATCHES, run_one_process, run_ranks, spec

SETTINGS = {"lr": 1e-3, "micro_batch_tokens": 48, "torch_threads": 1}
OFFLOADING = {**SETTINGS, "offload_when_lent": "on"}


def offloading_spec(model_dir: Path, out: Path) -> dict[str, Any]:
    return {**spec(model_dir, BATCHES, out, settings=OFFLOADING), "offload_between_steps": True}


def assert_same_training(got: list[dict[str, Any]], expected: list[dict[str, Any]]) -> None:
    """Bitwise: the same process layout runs the same kernels on the same bytes."""
    for a, b in zip(got, expected, strict=True):
        for key, value in b.items():
            assert a[key] == value, key


def assert_same_checkpoint(got: Path, expected: Path) -> None:
    mine, theirs = load_model_state(got), load_model_state(expected)
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def test_one_process_offloads_between_steps_and_trains_as_without(
    base_model_dir: Path, tmp_path: Path
) -> None:
    offloaded = run_one_process(offloading_spec(base_model_dir, tmp_path / "offloaded"))
    plain = run_one_process(spec(base_model_dir, BATCHES, tmp_path / "plain", settings=SETTINGS))
    assert_same_training(offloaded, plain)
    assert_same_checkpoint(tmp_path / "offloaded" / "checkpoint", tmp_path / "plain" / "checkpoint")

    # what moved: each weight once (a tied matrix too), AdamW's two moments of it, and
    # one float32 step counter per weight
    weights = load_model_state(tmp_path / "plain" / "checkpoint")
    held = 3 * sum(t.numel() * t.element_size() for t in weights.values()) + 4 * len(weights)
    for step in offloaded:
        offload = step["offload"]
        assert offload["before"]["on_device"] == held
        assert offload["after"] == {"on_device": 0, "host_copies": held, "allocated": None}
    first, second = offloaded
    assert first["reload"]["after"]["on_device"] == held  # the explicit reload
    assert first["reload"]["after"]["host_copies"] == 0
    assert second["reload"] is None  # reloaded by the save that followed


def test_two_ranks_offload_their_shards_and_train_as_without(
    base_model_dir: Path, tmp_path: Path
) -> None:
    offloaded = run_ranks(2, offloading_spec(base_model_dir, tmp_path / "offloaded"))
    plain = run_ranks(2, spec(base_model_dir, BATCHES, tmp_path / "plain", settings=SETTINGS))
    assert_same_training(offloaded, plain)
    assert_same_checkpoint(tmp_path / "offloaded" / "checkpoint", tmp_path / "plain" / "checkpoint")

    weights = load_model_state(tmp_path / "plain" / "checkpoint")
    whole = 3 * sum(t.numel() * t.element_size() for t in weights.values())
    for step in offloaded:
        offload = step["offload"]
        # rank 0's shard (FSDP2 pads each tensor's rows to the ranks): about half
        assert 0.4 * whole < offload["before"]["on_device"] < 0.6 * whole
        assert offload["after"]["on_device"] == 0
        assert offload["after"]["host_copies"] == offload["before"]["on_device"]
