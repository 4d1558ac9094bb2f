"""``seamlessflow up --model NAME``: a packaged pretrained model by name, and the run
defaults it carries (``PackagedModel.run_defaults``), below what the user and the task
set. Pure units: nothing is converted or loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from seamlessflow.assets.pretrained import PRETRAINED, PretrainedUnavailable, packaged_model
from sf_app.run.config import RunConfig

NAME = "smollm2-135m-instruct"


def test_a_pretrained_model_brings_its_run_defaults() -> None:
    defaults = packaged_model(NAME).run_defaults
    config = RunConfig(model=NAME)
    for name, value in defaults.items():
        assert getattr(config, name) == value, name
    # without the model, the built-in toy's defaults
    plain = RunConfig()
    assert any(getattr(plain, name) != value for name, value in defaults.items())


def test_what_the_user_sets_wins_over_the_models_defaults() -> None:
    config = RunConfig(model=NAME, lr=3e-6, group_size=4, precision="fp32")
    assert (config.lr, config.group_size, config.precision) == (3e-6, 4, "fp32")
    assert config.groups_per_batch == packaged_model(NAME).run_defaults["groups_per_batch"]


def test_a_tasks_completion_budget_wins_over_the_models() -> None:
    config = RunConfig(model=NAME, task="rg:chain_sum?max_tokens=40")
    assert config.max_tokens == 40
    assert config.max_tokens != packaged_model(NAME).run_defaults["max_tokens"]
    assert RunConfig(model=NAME, task="rg:chain_sum", max_tokens=12).max_tokens == 12


def test_an_unknown_model_or_two_models_are_refused_naming_the_known_ones() -> None:
    with pytest.raises(ValidationError, match=NAME):
        RunConfig(model="smollm3-9b")
    with pytest.raises(PretrainedUnavailable, match=", ".join(sorted(PRETRAINED))):
        packaged_model("nope")
    with pytest.raises(ValidationError, match="model_dir"):
        RunConfig(model=NAME, model_dir=Path("/models/mine"))


def test_a_task_whose_extra_is_missing_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    # as if not installed (a submodule an earlier test imported is found by its own name)
    for name in [m for m in sys.modules if m.split(".")[0] == "reasoning_gym"] + ["reasoning_gym"]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ValidationError, match=r"seamlessflow\[reasoning\]"):
        RunConfig(model=NAME)  # its default task is a reasoning-gym one
