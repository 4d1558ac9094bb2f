"""Rebalance on lend, on its own (``sf_tag_scheduler.rebalance``; the properties of the
plan over many loads are checked through the policy in test_tag_policy.py)."""

from __future__ import annotations

from sf_tag_scheduler.rebalance import Shed, shed_plan


def test_a_lent_engine_is_filled_to_the_mean_from_the_busiest_first() -> None:
    plan = shed_plan({"a": 10, "b": 6, "t": 0}, ["t"])
    assert plan == [Shed("a", "t", 5)]  # the mean is 5: a alone fills it, b keeps its 6


def test_nothing_moves_without_targets_loads_or_excess() -> None:
    assert shed_plan({"a": 3}, []) == []
    assert shed_plan({}, ["t"]) == []
    assert shed_plan({"a": 2, "t": 2}, ["t"]) == []
