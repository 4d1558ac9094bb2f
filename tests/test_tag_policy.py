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
    # no dedicated engine: no wait estimate is possible, lending stays unconditional
    assert p.no_lend_wait.samples == 0 and p.trainer_waiting(5.0).lend == ("e0", "e1", "e2")


def test_multiplexed_lends_when_the_expected_wait_beats_the_switch_cost() -> None:
    p = policy("multiplexed", switch_cost_prior_s=1.0, ewma_alpha=1.0)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.add(trainer("train"))
    first = p.trainer_waiting(0.0)
    assert first.lend == ("lend",) and "measure" in first.reason
    # 1 dedicated + 1 lent engine served for 4 s: alone, the dedicated one needs ~8 s
    assert p.trainer_claims(4.0).reclaim == ("lend",)
    assert p.expected_wait() == pytest.approx(8.0)
    p.observe_lend(0.5)
    p.observe_reclaim(0.3)
    plan = p.trainer_waiting(10.0)
    assert plan.lend == ("lend",)
    assert plan.gain_s == pytest.approx(7.5) and plan.cost_s == pytest.approx(0.3)


def test_multiplexed_declines_when_switching_costs_more_than_the_wait() -> None:
    p = policy("multiplexed", ewma_alpha=1.0)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.trainer_waiting(0.0)
    p.trainer_claims(0.2)  # batches arrive almost at once: W = 0.4 s
    p.observe_lend(2.0)  # waking and catching up takes longer than the wait
    p.observe_reclaim(0.5)
    plan = p.trainer_waiting(1.0)
    assert plan.lend == () and "<=" in plan.reason
    assert p.role_of("lend").role == "idle" and p.stats.declined == 1
    # nothing was lent, so the claim takes nothing back and W is measured unscaled
    assert p.trainer_claims(1.3).reclaim == ()
    assert p.expected_wait() == pytest.approx(0.3)


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
    p = policy("multiplexed", ewma_alpha=1.0, lend_margin=100.0)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.trainer_waiting(0.0)
    p.trainer_claims(1.0)
    assert p.trainer_waiting(2.0).lend == ()  # margin 100: not worth it
    p.remove("dedicated")
    plan = p.rebalance(3.0)  # without it, the wait is unbounded
    assert plan.lend == ("lend",) and math.isinf(plan.expected_wait_s)
    assert p.dedicated == [] and p.role_of("lend").role == "rollout"


def test_a_dead_lent_engine_is_not_reclaimed() -> None:
    p = policy("colocated")
    p.add(engine("a", "train", "rollout"))
    p.add(engine("b", "train", "rollout"))
    p.trainer_waiting(0.0)
    p.remove("a")
    assert p.trainer_claims(1.0).reclaim == ("b",)


def test_a_lent_engine_that_gets_no_work_stops_being_lent_and_is_probed_again() -> None:
    """The trainer waits long (W is large), but the measured yield of lending is ~0:
    the next batch's requests were all taken by dedicated engines before the lent one
    woke. The policy trusts the measurement, then re-measures after a few declines."""
    p = policy("multiplexed", ewma_alpha=1.0, reprobe_after=3)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.trainer_waiting(0.0)
    p.trainer_claims(20.0)  # a 20 s wait with one lent engine: W = 40 s
    p.observe_reclaim(0.5)
    p.observe_yield(0.0)  # ... during which the lent engine served nothing
    for start in (30.0, 60.0):
        plan = p.trainer_waiting(start)
        assert plan.lend == () and "measured yield" in plan.reason
        p.trainer_claims(start + 20.0)
    assert p.stats.declined == 2
    probe = p.trainer_waiting(100.0)
    assert probe.lend == ("lend",) and "re-measure" in probe.reason
    p.trainer_claims(110.0)
    p.observe_yield(8.0)  # this time it was busy for 8 s: worth the 0.5 s reclaim
    plan = p.trainer_waiting(120.0)
    assert plan.lend == ("lend",) and plan.gain_s == pytest.approx(8.0)
