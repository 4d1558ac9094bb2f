"""The built-in plug-ins are listed once, by their registries: a setting that names
plug-ins says which registry (``ChosenFrom``), the configuration reference lists what is
registered there (with each one's summary and keys), and the setting's docstring names
none of them by hand.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from seamlessflow.plugins import ChosenFrom, first_paragraph, keys_of, summary_of
from sf_app.cli import configuration_reference, settings_classes
from sf_app.plugin_reference import chosen_from
from sf_trainer.losses import LOSSES
from sf_trainer.settings import RETIRED_LOSS_SETTINGS


def chosen_settings() -> list[tuple[str, str, ChosenFrom]]:
    """(variable, field docstring, marker) of every setting that names plug-ins."""
    found = []
    for settings_class in settings_classes():
        prefix = str(settings_class.model_config.get("env_prefix", ""))
        for name, info in settings_class.model_fields.items():
            marker = chosen_from(info)
            if marker is not None:
                found.append((f"{prefix}{name}".upper(), info.description or "", marker))
    return found


CHOSEN = chosen_settings()
VARIABLES = [variable for variable, _, _ in CHOSEN]


@pytest.fixture(scope="module")
def reference() -> str:
    return configuration_reference()


def test_the_plugin_settings_are_marked() -> None:
    assert set(VARIABLES) >= {
        "SF_TRAINER_LOSS",
        "SF_TRAINER_ADVANTAGE",
        "SF_TRAJECTORY_DATA_FILTERS",
        "SF_ENGINE_BACKEND",
    }


@pytest.mark.parametrize(("variable", "docstring", "marker"), CHOSEN, ids=VARIABLES)
def test_the_reference_lists_what_the_registry_holds(
    variable: str, docstring: str, marker: ChosenFrom, reference: str
) -> None:
    registry = marker.load()
    assert registry.setting == variable  # the registry's errors name the same variable
    [row] = [line for line in reference.splitlines() if line.startswith(f"| `{variable}` |")]
    names = registry.names()
    assert names and f"Registered: {', '.join(f'`{n}`' for n in names)}" in row
    section = reference.split(f"### `{variable}` ({registry.kind})", 1)[1].split("\n### ")[0]
    for name in names:
        plugin = registry.find(name)
        assert summary_of(plugin), name
        assert f"| `{name}` | {summary_of(plugin).replace('|', chr(92) + '|')} |" in section
        for key in keys_of(plugin):
            assert f"`{key.name}` ({key.default!s})" in section


@pytest.mark.parametrize(("variable", "docstring", "marker"), CHOSEN, ids=VARIABLES)
def test_the_settings_docstring_leaves_the_list_to_the_registry(
    variable: str, docstring: str, marker: ChosenFrom
) -> None:
    named = [n for n in marker.load().names() if re.search(rf"``{re.escape(n)}``", docstring)]
    assert named == [], f"{variable}'s docstring lists {named}: the registry does"


def test_a_summary_is_the_first_paragraph_on_one_line() -> None:
    def documented() -> None:
        """First line,
        second line.

        Not this."""

    assert first_paragraph(documented.__doc__) == "First line, second line."
    assert summary_of(documented) == "First line, second line."
    assert first_paragraph(None) == ""


def test_a_retired_loss_setting_names_losses_that_have_its_key() -> None:
    # a record of where each flat setting went (not a list of the losses: a loss added
    # later with the same key never read the flat setting)
    for field, (key, losses) in RETIRED_LOSS_SETTINGS.items():
        for name in re.split(r", | or ", losses):
            loss: Any = LOSSES.find(name)
            assert loss is not None, (field, name)
            assert key in loss.settings_class.model_fields, (field, name, key)
