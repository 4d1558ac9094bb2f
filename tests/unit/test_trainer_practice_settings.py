"""Two of the trainer's practice settings on their own: the learning-rate schedule
follows its formula (constant, linear and cosine decay after a warmup) at chosen steps,
and weights travel in the precision the trainer computes in unless
``SF_WEIGHTS_DTYPE`` says otherwise. Training with them on is
tests/mesh/test_trainer_practice.py."""

from __future__ import annotations

import math

import pytest

from sf_trainer.schedule import lr_at
from sf_trainer.settings import TrainerSettings


def test_the_schedule_follows_its_formula_at_chosen_steps() -> None:
    def at(step: int, **settings: object) -> float:
        return lr_at(step, TrainerSettings(lr=1e-3, steps=10, **settings))  # type: ignore[arg-type]

    warm = {"warmup_steps": 2, "min_lr_ratio": 0.1}
    # constant: the peak at every step, no warmup
    assert [at(s) for s in (0, 5, 9)] == [1e-3, 1e-3, 1e-3]
    # warmup: lr (s + 1) / warmup, whatever the decay
    for schedule in ("constant", "linear", "cosine"):
        assert at(0, lr_schedule=schedule, **warm) == pytest.approx(0.5e-3)
        assert at(1, lr_schedule=schedule, **warm) == pytest.approx(1e-3)
    # decay over the 8 steps after the warmup: p = (s - 2) / 8
    assert at(2, lr_schedule="linear", **warm) == pytest.approx(1e-3)  # p = 0
    assert at(4, lr_schedule="linear", **warm) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.75))
    assert at(4, lr_schedule="cosine", **warm) == pytest.approx(
        1e-3 * (0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2)
    )
    assert at(6, lr_schedule="cosine", **warm) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    # the end of the run (and past it: a step budget raised on restart) is the floor
    assert at(10, lr_schedule="cosine", **warm) == pytest.approx(1e-4)
    assert at(12, lr_schedule="linear", **warm) == pytest.approx(1e-4)


def test_weights_travel_in_the_precision_the_trainer_computes_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sf_trainer.service import weight_transfer

    monkeypatch.delenv("SF_WEIGHTS_DTYPE", raising=False)
    assert weight_transfer(TrainerSettings(precision="bf16-mixed")).dtype == "bfloat16"
    assert weight_transfer(TrainerSettings(precision="fp32")).dtype == ""  # its float32
    monkeypatch.setenv("SF_WEIGHTS_DTYPE", "float32")  # the user's choice wins
    assert weight_transfer(TrainerSettings(precision="bf16-mixed")).dtype == "float32"
