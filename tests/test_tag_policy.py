"""The scheduling policy on its own: tag matching, lending and reclaiming decisions.

The policy has no I/O and takes time as an argument, so these tests drive it on a
virtual clock, as the simulator does.
"""

from __future__ import annotations

import math

import pytest

from sf_tag_scheduler.policy import PolicyConfig, ResourceView, TagPolicy


def engine(rid: str, *tags: str) -> ResourceView:
    return ResourceView(rid, "engine", frozenset(tags), (rid,))


def trainer(*tags: str) -> ResourceView:
    return ResourceView("trainer", "trainer", frozenset(tags), ("slot-t",))


def policy(mode: str, **config: float) -> TagPolicy:
    return TagPolicy(PolicyConfig(mode=mode, **config))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("view", "role"),
    [
        (engine("e", "rollout"), "rollout"),
        (engine("e", "rollout", "gpu:h100", "region:x"), "rollout"),
        (engine("e", "gpu:h100"), "idle"),  # an engine without the rollout tag gets no work
        (trainer("train"), "train"),
        (trainer("rollout"), "idle"),
        (ResourceView("x", "reward-model", frozenset({"rollout"})), "idle"),
    ],
)
def test_roles_follow_tags(view: ResourceView, role: str) -> None:
    decision = policy("disaggregated").add(view)
    assert decision.role == role, decision.reason


def test_the_tags_make_the_deployment() -> None:
    assert engine("e", "train", "rollout").lendable
    assert not engine("e", "rollout").lendable and engine("e", "rollout").dedicated_rollout
    assert not trainer("train", "rollout").lendable  # only engines are lent


def test_disaggregated_never_lends() -> None:
    p = policy("disaggregated")
    p.add(engine("e0", "rollout"))
    p.add(engine("lend", "train", "rollout"))  # tags allow it, the mode does not
    p.add(trainer("train"))
    assert p.trainer_waiting(0.0).lend == ()
    assert p.role_of("lend").role == "idle"
    assert p.trainer_claims(5.0).reclaim == () and p.stats.lends == 0


def test_colocated_lends_every_slot_and_reclaims_all_for_training() -> None:
    p = policy("colocated")
    for i in range(3):
        p.add(engine(f"e{i}", "train", "rollout"))
    p.add(trainer("train", "rollout"))
    plan = p.trainer_waiting(0.0)
    assert plan.lend == ("e0", "e1", "e2") and math.isinf(plan.expected_wait_s)
    assert all(p.role_of(f"e{i}").role == "rollout" for i in range(3))
    claim = p.trainer_claims(4.0)
    assert claim.reclaim == ("e0", "e1", "e2")
    assert all(p.role_of(f"e{i}").role == "idle" for i in range(3))
    # no dedicated engine: there is no "without lending" to compare, lending stays
    assert p.wait_alone.samples == 0 and p.trainer_waiting(5.0).lend == ("e0", "e1", "e2")


def multiplexed_pair(**config: float) -> TagPolicy:
    p = policy("multiplexed", ewma_alpha=1.0, **config)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.add(trainer("train"))
    return p


def explore(p: TagPolicy, wait_lent: float, wait_alone: float, reclaim: float) -> float:
    """The first wait fills the pipeline (not measured), the next two measure both
    choices; returns the time after them."""
    filling = p.trainer_waiting(-100.0)
    assert filling.lend == ("lend",) and "not measured" in filling.reason
    p.trainer_claims(-100.0 + 60.0)  # a long first wait: it must not count
    first = p.trainer_waiting(0.0)
    assert first.lend == ("lend",) and "lend to measure" in first.reason
    p.trainer_claims(wait_lent)
    p.observe_reclaim(reclaim)
    second = p.trainer_waiting(100.0)
    assert second.lend == () and "keep the slots to measure" in second.reason
    p.trainer_claims(100.0 + wait_alone)
    return 200.0


def test_multiplexed_lends_when_lending_shortens_the_wait_more_than_the_reclaim_costs() -> None:
    p = multiplexed_pair()
    now = explore(p, wait_lent=4.0, wait_alone=8.0, reclaim=0.3)
    plan = p.trainer_waiting(now)
    assert plan.lend == ("lend",) and plan.reason.startswith("gain 4.000s > cost 0.300s")
    assert plan.gain_s == pytest.approx(4.0) and plan.expected_wait_s == pytest.approx(8.0)
    assert p.role_of("lend").role == "rollout"


def test_multiplexed_declines_when_lending_does_not_shorten_the_wait() -> None:
    """The lent engine may look busy, but the batch came no sooner (the next batch's
    requests were on dedicated engines, or rollout is bound elsewhere): the trainer
    only paid the reclaim. The measured waits show it."""
    p = multiplexed_pair()
    now = explore(p, wait_lent=1.54, wait_alone=1.53, reclaim=0.5)
    plan = p.trainer_waiting(now)
    assert plan.lend == () and "<= cost 0.500s" in plan.reason
    assert p.role_of("lend").role == "idle" and p.stats.declined == 1
    assert p.trainer_claims(now + 1.5).reclaim == ()


def test_after_many_alike_decisions_the_other_choice_is_measured_again() -> None:
    """Early on lending did not pay; later the workload changed and it does (a lent
    engine now cuts the wait to 0.5 s). Only re-measuring finds that out."""
    p = multiplexed_pair(reprobe_after=3)
    now = explore(p, wait_lent=2.0, wait_alone=2.0, reclaim=0.5)  # no gain: decline
    lent = []
    for i in range(4):
        plan = p.trainer_waiting(now + 10 * i)
        lent.append(bool(plan.lend))
        p.trainer_claims(now + 10 * i + (0.5 if plan.lend else 2.0))
        if i in (1, 3):
            assert "re-measure" in plan.reason
    # explore ended with a decline, one more makes 2 alike, the third is flipped (a
    # lend, which now pays); after 3 lends alike the slots are kept once to re-measure
    assert lent == [False, True, True, False]
    assert p.wait_lent.value == pytest.approx(0.5) and p.expected_gain() == pytest.approx(1.5)


def test_a_late_lendable_engine_is_lent_while_the_trainer_waits() -> None:
    p = policy("colocated")
    p.add(trainer("train"))
    p.trainer_waiting(0.0)
    p.add(engine("late", "train", "rollout"))
    assert p.rebalance(1.0).lend == ("late",) and p.role_of("late").role == "rollout"
    p.trainer_claims(2.0)
    p.add(engine("later", "train", "rollout"))
    assert p.rebalance(2.5).lend == ()  # the trainer is training: nothing is lent
    assert p.role_of("later").role == "idle"


def test_losing_the_last_dedicated_engine_lends_the_rest() -> None:
    p = multiplexed_pair(lend_margin=100.0)
    now = explore(p, wait_lent=1.0, wait_alone=1.5, reclaim=0.1)
    assert p.trainer_waiting(now).lend == ()  # margin 100: not worth it
    p.remove("dedicated")
    plan = p.rebalance(now + 1)  # without it, lending is all the rollout there is
    assert plan.lend == ("lend",) and math.isinf(plan.expected_wait_s)
    assert p.dedicated == [] and p.role_of("lend").role == "rollout"


def test_a_dead_lent_engine_is_not_reclaimed() -> None:
    p = policy("colocated")
    p.add(engine("a", "train", "rollout"))
    p.add(engine("b", "train", "rollout"))
    p.trainer_waiting(0.0)
    p.remove("a")
    assert p.trainer_claims(1.0).reclaim == ("b",)
