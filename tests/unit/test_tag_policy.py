"""The scheduling policy on its own: tag matching, lending and reclaiming decisions.

The policy has no I/O and takes time as an argument, so these tests drive it on a
virtual clock, as the simulator does.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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
    assert p.period_alone.samples == 0 and p.trainer_waiting(5.0).lend == ("e0", "e1", "e2")


def auto_pair(**config: float) -> TagPolicy:
    p = policy("auto", ewma_alpha=1.0, **config)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.add(trainer("train"))
    return p


def run_steps(
    p: TagPolicy, steps: int, period: Callable[[bool, bool | None], float], now: float = 0.0
) -> tuple[list[bool], float]:
    """Drive ``steps`` trainer steps: wait, claim at once, train; a step lasts
    ``period(lent, lent at the step before)`` (the carry-over of a pipelined run).
    Returns whether each wait lent, and the time after them."""
    lent: list[bool] = []
    for _ in range(steps):
        plan = p.trainer_waiting(now)
        lent.append(bool(plan.lend))
        p.trainer_claims(now)
        now += period(lent[-1], lent[-2] if len(lent) > 1 else None)
    return lent, now


def steady(lent_s: float, alone_s: float) -> Callable[[bool, bool | None], float]:
    return lambda lent, _before: lent_s if lent else alone_s


def test_auto_lends_when_steps_per_second_are_higher_with_lending() -> None:
    p = auto_pair(block_steps=3)
    lent, now = run_steps(p, 1 + 3 + 3 + 3, steady(lent_s=5.0, alone_s=8.0))
    # fill (not measured), a block lends, a block keeps, then the rule: lending pays
    assert lent == [True, *[True] * 3, *[False] * 3, *[True] * 3]
    assert p.period_lent.value == pytest.approx(5.0)
    assert p.period_alone.value == pytest.approx(8.0)
    plan = p.trainer_waiting(now)
    assert plan.gain_s == pytest.approx(3.0) and plan.expected_wait_s == pytest.approx(8.0)
    assert plan.lend == ("lend",) and p.role_of("lend").role == "rollout"


def test_auto_declines_when_lending_does_not_raise_steps_per_second() -> None:
    """The lent engine may look busy and the wait may even be shorter, but if the step
    period is not (the reclaim, a catch-up, re-prefills elsewhere ate it), it declines."""
    p = auto_pair(block_steps=3)
    lent, _ = run_steps(p, 1 + 3 + 3 + 3 + 3, steady(lent_s=8.2, alone_s=8.0))
    # fill, lend, keep, lend again (the bracket), then the rule keeps the slots
    assert lent == [True, *[True] * 3, *[False] * 3, *[True] * 3, *[False] * 3]
    assert p.stats.declined == 6 and p.role_of("lend").role == "idle"
    assert "keeps" in p.stats.decisions[-2] or "keep the slots" in p.stats.decisions[-2]


def test_the_first_period_of_a_block_is_not_counted() -> None:
    """A pipelined step carries over the choice before it: the first period after a
    switch is not what the new choice yields, so it is left out of the measurement."""
    p = auto_pair(block_steps=3)

    def carried(lent: bool, before: bool | None) -> float:
        return 100.0 if before is not None and lent != before else (5.0 if lent else 8.0)

    run_steps(p, 1 + 3 + 3 + 1, carried)
    assert p.period_lent.value == pytest.approx(5.0)
    assert p.period_alone.value == pytest.approx(8.0)


def test_after_many_alike_blocks_the_other_choice_is_measured_again() -> None:
    """Early on lending did not pay; later the workload changed and it does (a lent
    step now takes 2 s). Only re-measuring finds that out."""
    p = auto_pair(block_steps=2, reprobe_after=2)
    lent, now = run_steps(p, 1 + 2 + 2 + 2 + 2, steady(lent_s=8.5, alone_s=8.0))
    assert lent == [True, True, True, False, False, True, True, False, False]
    more, _ = run_steps(p, 2 + 2 + 2 + 2, steady(lent_s=2.0, alone_s=8.0), now)
    # two blocks kept: the next one lends to re-measure, one keeps to bracket it; lending
    # pays now, so the rule lends
    assert more == [False, False, True, True, False, False, True, True]
    assert any("re-measure" in d for d in p.stats.decisions)
    assert p.expected_gain() == pytest.approx(6.0)
    # the rule's choice: keep the slots once both were measured, then lend once the
    # re-measuring block showed it pays; the re-measuring block itself is no switch
    first, second = p.when_pays.switches
    assert (first.before, first.after) == (None, 0.0) and "lent >=" in first.reason
    assert (second.before, second.after) == (0.0, 1.0) and "lent <" in second.reason
    assert second.block > first.block
    assert [d for d in p.stats.decisions if d.startswith("switch:")] == [
        f"switch: {first.in_words()}",
        f"switch: {second.in_words()}",
    ]
    assert first.in_words().startswith("unmeasured -> keeps the slots (step 8.500s lent")


def test_a_confirmed_choice_is_re_measured_less_and_less_often_until_it_switches() -> None:
    p = auto_pair(block_steps=1, reprobe_after=2, reprobe_backoff_max=4)
    lent, now = run_steps(p, 1 + 1 + 1 + 40, steady(lent_s=5.0, alone_s=8.0))
    # after the fill and the two measuring blocks, lending pays: the blocks that keep
    # the slots to re-measure come after 2, 4, 8, then 8 (the cap) lending blocks
    kept = [i for i, was_lent in enumerate(lent) if not was_lent]
    assert kept == [2, 5, 10, 19, 28, 37]
    assert p.when_pays.reprobe_interval == 8
    # the workload changes: lending now costs; the rule switches, and the interval is
    # back at its base
    switches = len(p.when_pays.switches)
    for _ in range(3):
        _, now = run_steps(p, 1, steady(lent_s=9.0, alone_s=8.0), now)
    assert len(p.when_pays.switches) == switches + 1
    assert p.when_pays.switches[-1].after == 0.0 and p.when_pays.reprobe_interval == 2


def test_only_the_wait_that_begins_a_switched_block_carries_the_switch() -> None:
    p = auto_pair(block_steps=2)
    switched: list[bool] = []
    now = 0.0
    for _ in range(1 + 2 + 2 + 4):
        plan = p.trainer_waiting(now)
        switched.append(plan.switch is not None)
        p.trainer_claims(now)
        now += 5.0 if plan.lend else 8.0
    # fill, a block lending, a block keeping, a block lending (exploring and its
    # bracket), then the rule lends: one switch
    assert switched == [False, False, False, False, False, False, False, True, False]


def test_multiplexed_lends_at_every_wait_whatever_it_measures() -> None:
    p = policy("multiplexed", ewma_alpha=1.0)
    p.add(engine("dedicated", "rollout"))
    p.add(engine("lend", "train", "rollout"))
    p.add(trainer("train"))
    lent, _ = run_steps(p, 10, steady(lent_s=9.0, alone_s=8.0))
    assert lent == [True] * 10 and p.stats.declined == 0 and not p.when_pays.switches
    # auto, on the same steps, stops lending once it has measured both
    a = auto_pair(block_steps=3)
    lent, _ = run_steps(a, 13, steady(lent_s=9.0, alone_s=8.0))
    assert lent == [True, *[True] * 3, *[False] * 3, *[True] * 3, *[False] * 3]


@pytest.mark.parametrize(
    ("loads", "targets"),
    [
        ({"a": 10, "b": 6, "t": 0}, ["t"]),
        ({"a": 12, "b": 12, "c": 1, "t": 0, "u": 0}, ["t", "u"]),
        ({"a": 3, "b": 3, "t": 2}, ["t"]),
        ({"a": 0, "t": 0}, ["t"]),
    ],
)
def test_shed_plan_fills_lent_engines_to_the_mean_from_the_busiest(
    loads: dict[str, int], targets: list[str]
) -> None:
    plan = policy("auto").shed_plan(loads, targets)
    after = dict(loads)
    for move in plan:
        assert move.donor not in targets and move.target in targets and move.count > 0
        after[move.donor] -= move.count
        after[move.target] += move.count
    share = sum(loads.values()) // len(loads)
    assert sum(after.values()) == sum(loads.values())  # nothing lost or made up
    for rid in loads:
        if rid in targets:  # filled up to the share, never beyond
            assert after[rid] == max(loads[rid], share) or all(
                after[d] <= share for d in loads if d not in targets
            )
            assert after[rid] <= max(loads[rid], share)
        else:  # a donor is never taken below the share
            assert after[rid] >= min(loads[rid], share)
    # the busiest engine gives first
    if plan:
        assert plan[0].donor == max((r for r in loads if r not in targets), key=loads.__getitem__)


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
    p = auto_pair(lend_margin=100.0, block_steps=1)
    lent, now = run_steps(p, 4, steady(lent_s=1.0, alone_s=1.5))
    assert lent == [True, True, False, True]
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


def auto_quad(**config: object) -> TagPolicy:
    """One dedicated engine and four lendable ones on the trainer's slots."""
    p = TagPolicy(PolicyConfig(mode="auto", ewma_alpha=1.0, **config))  # type: ignore[arg-type]
    p.add(engine("dedicated", "rollout"))
    for i in range(4):
        p.add(engine(f"lend{i}", "train", "rollout"))
    p.add(trainer("train"))
    return p


def test_lending_part_of_the_lendable_engines_when_that_is_fastest() -> None:
    """Granularity: with shares (0.5, 1.0) each of none, half and all is measured in a
    block of its own (all, none, half), then the shortest step period wins."""
    p = auto_quad(block_steps=2, lend_shares=(0.5, 1.0))
    periods = {0: 9.0, 2: 5.0, 4: 7.0}  # step period by engines lent
    now, lent = 0.0, []
    for _ in range(1 + 2 * 4 + 4):
        plan = p.trainer_waiting(now)
        lent.append(len(p.lent))
        assert len(plan.lend) == len(p.lent)  # nothing was left lent from before
        p.trainer_claims(now)
        now += periods[lent[-1]]
    # fill (all, not measured), then all, none, half, all again (the bracket) measured,
    # then half: fastest
    assert lent == [4, 4, 4, 0, 0, 2, 2, 4, 4, 2, 2, 2, 2]
    assert p.periods[0.5].value == pytest.approx(5.0)
    assert p.period_lent.value == pytest.approx(7.0)
    assert p.period_alone.value == pytest.approx(9.0)
    assert any("shortest step: lends 50%" in d for d in p.stats.decisions)
    # the engines lent are the first by id, and a claim takes back exactly those
    assert p.trainer_waiting(now).lend == ("lend0", "lend1")
    assert p.trainer_claims(now).reclaim == ("lend0", "lend1")


def test_a_share_must_beat_keeping_the_slots_by_the_margin() -> None:
    p = auto_quad(block_steps=1, lend_shares=(0.5, 1.0), lend_margin=0.5)
    periods = {0: 9.0, 2: 7.0, 4: 6.5}  # lending is faster, but not by 50%
    now, lent = 0.0, []
    for _ in range(1 + 4 + 3):
        p.trainer_waiting(now)
        lent.append(len(p.lent))
        p.trainer_claims(now)
        now += periods[lent[-1]]
    assert lent == [4, 4, 0, 2, 4, 0, 0, 0]


@pytest.mark.parametrize("shares", [(), (0.0, 1.0), (0.5,), (1.5, 1.0)])
def test_bad_lend_shares_are_refused(shares: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="lend_shares"):
        PolicyConfig(mode="auto", lend_shares=shares)


def test_an_early_reclaim_takes_the_lent_engines_back_before_the_claim() -> None:
    p = auto_quad()
    assert len(p.trainer_waiting(0.0).lend) == 4
    early = p.trainer_prepares(1.0)
    assert early.reclaim == ("lend0", "lend1", "lend2", "lend3")
    assert all(p.role_of(f"lend{i}").role == "idle" for i in range(4))
    # the rest of this wait lends nothing again, a late joiner included
    p.add(engine("lend9", "train", "rollout"))
    assert p.rebalance(1.5).lend == () and p.role_of("lend9").role == "idle"
    assert p.trainer_claims(2.0).reclaim == ()  # nothing left to take back
    assert p.stats.reclaims == 4
    assert p.trainer_waiting(3.0).lend  # the next wait decides afresh


def test_without_a_dedicated_engine_nothing_is_taken_back_early() -> None:
    p = policy("colocated")
    p.add(engine("a", "train", "rollout"))
    p.add(trainer("train"))
    assert p.trainer_waiting(0.0).lend == ("a",)
    assert p.trainer_prepares(1.0).reclaim == ()  # it is all the rollout there is
    assert p.role_of("a").role == "rollout"
    assert p.trainer_claims(2.0).reclaim == ("a",)
