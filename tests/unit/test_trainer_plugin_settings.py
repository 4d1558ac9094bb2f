"""Losses and advantage estimators carry their own settings (``seamlessflow.plugin_settings``):
set in ``[trainer.loss]`` / ``SF_TRAINER_LOSS__<KEY>``, checked against the chosen
plug-in's settings class, and a loss may be the user's own, named by a dotted path."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from seamlessflow.bus import EXIT_UNRECOVERABLE
from seamlessflow.plugin_settings import NoSettings
from seamlessflow.runfile import RunFileError
from sf_app.cli import settings_classes
from sf_app.run.file import read_run_file
from sf_trainer.advantages import chosen_estimator
from sf_trainer.losses import DecoupledSettings, GspoSettings, chosen_loss
from sf_trainer.settings import RETIRED_LOSS_SETTINGS, TrainerSettings
from sf_trainer.step import train_step
from tests.support.tiny_models import BAD, GOOD, next_token_logprob, rewarded_batch, tiny_policy


def run_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(textwrap.dedent(text))
    return path


def loss_settings(settings: TrainerSettings) -> object:
    return chosen_loss(settings.loss)[1]


# defaults -------------------------------------------------------------------------------


def test_the_default_choices_and_their_settings(clean_environment: pytest.MonkeyPatch) -> None:
    settings = TrainerSettings()
    assert (settings.loss.name, settings.advantage.name) == ("grpo_decoupled", "grpo")
    assert loss_settings(settings) == DecoupledSettings(clip_eps=0.2, is_cap=2.0)
    assert chosen_estimator(settings.advantage)[1] == NoSettings()
    assert TrainerSettings(loss="gspo").loss.name == "gspo"  # a name alone, in code


# where the keys come from ---------------------------------------------------------------


def test_trainer_loss_section_keys_reach_the_loss(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    path = run_file(
        tmp_path,
        """
        [trainer.loss]
        name = "gspo"
        clip_eps_low = 0.1
        """,
    )
    clean_environment.setenv("SF_CONFIG", str(path))
    assert loss_settings(TrainerSettings()) == GspoSettings(clip_eps_low=0.1, clip_eps_high=4e-4)
    # a variable sets one more key, and wins over the file for its own
    clean_environment.setenv("SF_TRAINER_LOSS__CLIP_EPS_HIGH", "0.2")
    assert loss_settings(TrainerSettings()) == GspoSettings(clip_eps_low=0.1, clip_eps_high=0.2)
    clean_environment.setenv("SF_TRAINER_LOSS__CLIP_EPS_LOW", "0.3")
    assert loss_settings(TrainerSettings()) == GspoSettings(clip_eps_low=0.3, clip_eps_high=0.2)
    # the embedded run's check of the whole file takes the section too
    read_run_file(path, settings_classes())


def test_a_name_and_keys_merge_from_the_file_and_the_environment(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    clean_environment.setenv("SF_CONFIG", str(run_file(tmp_path, '[trainer]\nloss = "dapo"\n')))
    clean_environment.setenv("SF_TRAINER_LOSS__CLIP_EPS_HIGH", "0.3")
    settings = TrainerSettings()
    assert settings.loss.name == "dapo"
    assert loss_settings(settings).clip_eps_high == 0.3  # type: ignore[attr-defined]
    # the name in the environment, the key too
    clean_environment.delenv("SF_CONFIG")
    clean_environment.setenv("SF_TRAINER_LOSS", "grpo_decoupled")
    clean_environment.setenv("SF_TRAINER_LOSS__IS_CAP", "3")
    clean_environment.delenv("SF_TRAINER_LOSS__CLIP_EPS_HIGH")
    assert loss_settings(TrainerSettings()) == DecoupledSettings(is_cap=3.0)


# refusals ---------------------------------------------------------------------------------


def test_a_key_the_chosen_loss_lacks_is_refused_with_its_keys(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    expected = (
        "loss 'gspo' has no setting 'clip_eps' (SF_TRAINER_LOSS__CLIP_EPS); "
        "its keys: clip_eps_low, clip_eps_high"
    )
    with pytest.raises(ValidationError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        TrainerSettings(loss={"name": "gspo", "clip_eps": 0.1})
    clean_environment.setenv("SF_CONFIG", str(run_file(tmp_path, """
        [trainer.loss]
        name = "gspo"
        clip_eps = 0.1
        """)))  # fmt: skip
    with pytest.raises(ValidationError) as caught:
        TrainerSettings()
    assert expected in str(caught.value)
    clean_environment.delenv("SF_CONFIG")
    clean_environment.setenv("SF_TRAINER_LOSS", "grpo")
    clean_environment.setenv("SF_TRAINER_LOSS__CLIP_EPS_LOW", "0.1")
    with pytest.raises(ValidationError, match="loss 'grpo' has no setting 'clip_eps_low'"):
        TrainerSettings()
    # a value of the wrong type names the key
    clean_environment.delenv("SF_TRAINER_LOSS__CLIP_EPS_LOW")
    with pytest.raises(ValidationError, match=r"loss 'grpo': clip_eps = 'wide'"):
        TrainerSettings(loss={"name": "grpo", "clip_eps": "wide"})
    with pytest.raises(ValidationError, match="advantage estimator 'rloo' has no setting 'k'"):
        TrainerSettings(advantage={"name": "rloo", "k": 2})


@pytest.mark.parametrize("field", sorted(RETIRED_LOSS_SETTINGS))
def test_a_retired_flat_loss_variable_is_refused_with_the_new_spelling(
    field: str, clean_environment: pytest.MonkeyPatch
) -> None:
    key, _ = RETIRED_LOSS_SETTINGS[field]
    clean_environment.setenv(f"SF_TRAINER_{field.upper()}", "0.1")
    with pytest.raises(ValidationError) as caught:
        TrainerSettings()
    assert f"SF_TRAINER_{field.upper()} ([trainer] {field}) is no longer read" in str(caught.value)
    assert f"SF_TRAINER_LOSS__{key.upper()}" in str(caught.value)


def test_a_retired_flat_loss_key_in_the_run_file_is_refused_with_the_new_spelling(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    path = run_file(tmp_path, "[trainer]\ngspo_clip_eps_low = 0.1\n")
    clean_environment.setenv("SF_CONFIG", str(path))
    with pytest.raises(RunFileError) as caught:
        TrainerSettings()
    assert str(caught.value) == (
        f"run file {path}: SF_TRAINER_GSPO_CLIP_EPS_LOW ([trainer] gspo_clip_eps_low) is no "
        "longer read: the loss carries its settings, set SF_TRAINER_LOSS__CLIP_EPS_LOW (or "
        "clip_eps_low under [trainer.loss]) with the loss gspo"
    )


def test_a_trainer_with_a_retired_variable_exits_with_one_line_naming_the_new_one() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", "trainer"],
        env={**env, "SF_TRAINER_GSPO_CLIP_EPS_LOW": "0.1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("trainer: invalid settings"), line
    assert "SF_TRAINER_LOSS__CLIP_EPS_LOW" in line


# a loss of one's own ----------------------------------------------------------------------

OWN_LOSS = '''
"""A user's loss: GRPO's terms, scaled by its own setting."""

from sf_trainer.losses import LossInputs, LossSettings, PolicyLoss, PolicyTerms, grpo_terms
from sf_trainer.losses import PpoClipSettings, token_mean

CALLS = []


class ScaledSettings(LossSettings):
    scale: float = 1.0
    """What GRPO's terms are multiplied by."""


def scaled_terms(inputs: LossInputs, settings: ScaledSettings) -> PolicyTerms:
    CALLS.append(settings.scale)
    terms = grpo_terms(inputs, PpoClipSettings())
    return PolicyTerms(terms.per_token * settings.scale, terms.clipped)


scaled = PolicyLoss(scaled_terms, token_mean, ScaledSettings)
'''


def test_a_loss_from_a_dotted_path_with_its_own_settings_trains_a_step(
    tmp_path: Path, clean_environment: pytest.MonkeyPatch
) -> None:
    (tmp_path / "own_losses.py").write_text(OWN_LOSS)
    clean_environment.syspath_prepend(str(tmp_path))
    clean_environment.setenv("SF_TRAINER_LOSS", "own_losses:scaled")
    clean_environment.setenv("SF_TRAINER_LOSS__SCALE", "2.5")
    settings = TrainerSettings()
    own_losses = importlib.import_module("own_losses")  # written above, not a dependency

    model = tiny_policy()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = rewarded_batch(model)
    before_good, before_bad = next_token_logprob(model, GOOD), next_token_logprob(model, BAD)
    result = train_step(model, optimizer, batch, settings, current_version=0)
    assert own_losses.CALLS == [2.5]
    assert result.tokens_trained == 4
    assert next_token_logprob(model, GOOD) > before_good
    assert next_token_logprob(model, BAD) < before_bad
    # its keys are checked like a built-in loss's
    clean_environment.setenv("SF_TRAINER_LOSS__SCALES", "2")
    with pytest.raises(ValidationError, match="loss 'own_losses:scaled' has no setting 'scales'"):
        TrainerSettings()


def test_a_dotted_path_that_is_not_a_loss_is_refused(clean_environment: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        ValidationError, match=r"SF_TRAINER_LOSS='os.path:join': .*not a PolicyLoss"
    ):
        TrainerSettings(loss="os.path:join")
    with pytest.raises(ValidationError, match="SF_TRAINER_LOSS='no_such_module:loss'"):
        TrainerSettings(loss="no_such_module:loss")
