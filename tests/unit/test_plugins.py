"""One registry class for every kind of plug-in: rewards, agents, tasks, tool parsers,
engine backends, losses, advantage estimators and data filters."""

from __future__ import annotations

import pytest

from seamlessflow.agents import AGENTS
from seamlessflow.plugins import Registry, UnknownPlugin
from seamlessflow.rewards.registry import REWARDS
from seamlessflow.tasks import TASKS
from sf_engine.service import ENGINE_BACKENDS
from sf_gateway.tool_parsers import TOOL_PARSERS
from sf_trainer.advantages import ESTIMATORS
from sf_trainer.losses import LOSSES
from sf_trajectory.data_filters import DATA_FILTERS

REGISTRIES = {
    "reward": (REWARDS, "integer_match"),
    "agent": (AGENTS, "single_turn"),
    "task": (TASKS, "counting"),
    "tool parser": (TOOL_PARSERS, "hermes"),
    "engine backend": (ENGINE_BACKENDS, "scripted"),
    "loss": (LOSSES, "grpo"),
    "advantage estimator": (ESTIMATORS, "grpo"),
    "data filter": (DATA_FILTERS, "staleness"),
}


@pytest.mark.parametrize("kind", REGISTRIES)
def test_every_kind_of_plug_in_is_found_by_name_and_an_unknown_name_lists_the_known(
    kind: str,
) -> None:
    registry, known = REGISTRIES[kind]
    assert isinstance(registry, Registry) and registry.kind == kind
    assert known in registry.names()
    assert registry.get(known) is registry.find(known) is not None
    with pytest.raises(UnknownPlugin) as refused:
        registry.get("no-such-plug-in")
    message = str(refused.value)
    assert f"unknown {kind} 'no-such-plug-in' ({registry.setting})" in message
    assert known in message
    assert ("dotted path" in message) == registry.dotted_paths


def test_a_dotted_path_stands_for_a_name_only_where_allowed() -> None:
    from seamlessflow.rewards import integer_match

    assert REWARDS.get("seamlessflow.rewards:integer_match") is integer_match
    with pytest.raises(UnknownPlugin):
        TOOL_PARSERS.get("sf_gateway.tool_parsers:TOOL_PARSERS")


def test_two_plug_ins_under_one_name_are_refused_and_builtins_load_on_first_use() -> None:
    registry: Registry[object] = Registry("widget", "SF_WIDGET", builtins=("json",))
    first, second = object(), object()
    registry.add("a", first)
    registry.add("a", first)  # the same one again: a module imported twice
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        registry.add("a", second)

    @registry.register("b")
    def widget() -> None: ...

    assert registry.names() == ["a", "b"] and registry.get("b") is widget
