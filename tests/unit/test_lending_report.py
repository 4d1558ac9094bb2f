"""The run's report lists auto's lending switches from the tag-scheduler's
``sched.decide`` spans (the attributes ``sf_tag_scheduler.lending`` sets)."""

from __future__ import annotations

import json
from pathlib import Path

from sf_app.run.report import lending_switches
from sf_tag_scheduler.policy import PolicyConfig, ResourceView, TagPolicy


def decide_span(start: float, **attributes: object) -> dict[str, object]:
    attributes = {"policy": "policy", "lent": [], "reason": "r", **attributes}
    return {"name": "sched.decide", "start": start, "end": start + 0.001, "attributes": attributes}


def test_switches_are_read_in_the_order_decided_and_other_decisions_are_not(
    tmp_path: Path,
) -> None:
    spans = tmp_path / "spans.jsonl"
    lines = [
        decide_span(3.0, version=9, **{"switch.before": 0.0, "switch.after": 1.0,
                                       "switch.why": "step 2.000s lent < 8.000s alone"}),
        decide_span(1.0, version=4, **{"switch.before": -1.0, "switch.after": 0.0,
                                       "switch.why": "step 8.500s lent >= 8.000s alone"}),
        decide_span(2.0, version=6),  # a decision that did not switch
        {"name": "sched.lend", "start": 2.5, "end": 2.6, "attributes": {"lent": ["e"]}},
    ]  # fmt: skip
    spans.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert lending_switches(spans) == [
        {"policy": "policy", "version": 4, "before": None, "after": 0.0,
         "why": "step 8.500s lent >= 8.000s alone"},
        {"policy": "policy", "version": 9, "before": 0.0, "after": 1.0,
         "why": "step 2.000s lent < 8.000s alone"},
    ]  # fmt: skip
    assert lending_switches(tmp_path / "missing.jsonl") == []


def test_a_switch_reaches_the_lend_plan_the_scheduler_puts_on_its_span() -> None:
    """What ``SlotLending.on_release`` reads: the plan of the wait that begins the
    switched block carries the switch; its before/after/why are the span's attributes."""
    p = TagPolicy(PolicyConfig(mode="auto", ewma_alpha=1.0, block_steps=1))
    p.add(ResourceView("dedicated", "engine", frozenset({"rollout"})))
    p.add(ResourceView("lend", "engine", frozenset({"train", "rollout"})))
    p.add(ResourceView("trainer", "trainer", frozenset({"train"})))
    now, plans = 0.0, []
    for _ in range(5):
        plan = p.trainer_waiting(now)
        plans.append(plan)
        p.trainer_claims(now)
        now += 3.0 if plan.lend else 5.0
    switched = [plan for plan in plans if plan.switch is not None]
    assert len(switched) == 1
    (switch,) = (plan.switch for plan in switched)
    assert switch is not None and (switch.before, switch.after) == (None, 1.0)
    assert switched[0].lend == ("lend",) and "lent <" in switch.reason
