"""When lending pays, on its own: blocks of waits, the step periods they measure, and
the choice of each new block (``sf_tag_scheduler.when_pays``; the same rule through the
whole policy is in test_tag_policy.py)."""

from __future__ import annotations

import pytest

from sf_tag_scheduler.when_pays import Ewma, WhenPays, choice_in_words


def rule(*shares: float, block_steps: int = 2, reprobe_after: int = 10) -> WhenPays:
    return WhenPays(
        shares or (1.0,),
        block_steps=block_steps,
        reprobe_after=reprobe_after,
        lend_margin=0.0,
        ewma_alpha=1.0,
    )


def waits(
    when_pays: WhenPays, count: int, period: dict[float, float], now: float
) -> tuple[list[float], float]:
    """``count`` waits, each step lasting ``period[share lent]``; the shares, the time."""
    shares = []
    for _ in range(count):
        when_pays.period_ends(now)
        share, _reason, measured = when_pays.next_wait()
        when_pays.period_begins(now, measured)
        shares.append(share)
        now += period[share]
    return shares, now


def test_every_choice_is_measured_once_then_the_shortest_step_wins() -> None:
    when_pays = rule(0.5, 1.0, block_steps=2)
    shares, _ = waits(when_pays, 2 * 4 + 4, {0.0: 9.0, 0.5: 5.0, 1.0: 7.0}, 0.0)
    # lend all, keep the slots, then the other shares largest first, lend all again (the
    # bracket); then the rule
    assert shares == [1.0, 1.0, 0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    assert when_pays.periods[0.0].value == pytest.approx(9.0)
    assert when_pays.periods[0.5].value == pytest.approx(5.0)
    assert when_pays.periods[1.0].value == pytest.approx(7.0)


def test_the_first_period_of_a_block_measures_nothing() -> None:
    when_pays = rule(block_steps=3)
    when_pays.period_ends(0.0)
    share, reason, measured = when_pays.next_wait()
    assert (share, measured) == (1.0, None)  # carries over what came before
    assert "not measured yet: a block of 3 lends" in reason
    share, reason, measured = when_pays.next_wait()
    assert measured is not None and measured.share == 1.0 and "(2 of 3)" in reason


def test_a_period_counts_for_the_block_it_began_in() -> None:
    when_pays = rule(block_steps=1)
    when_pays.period_ends(0.0)
    _, _, measured = when_pays.next_wait()
    assert measured is not None  # blocks of one: the only period is measured
    when_pays.period_begins(0.0, measured)
    when_pays.period_ends(4.0)
    assert measured.periods == [4.0]


def test_choices_in_words() -> None:
    assert [choice_in_words(s) for s in (0.0, 0.5, 1.0)] == [
        "keeps the slots",
        "lends 50%",
        "lends",
    ]


def test_an_ewma_starts_at_its_prior_or_its_first_sample() -> None:
    prior, fresh = Ewma(0.5, prior=2.0), Ewma(0.5)
    prior.add(4.0)
    fresh.add(4.0)
    assert (prior.value, fresh.value, fresh.samples) == (3.0, 4.0, 1)


def drifting_waits(when_pays: WhenPays, count: int, lent_s: float, alone_s: float) -> list[float]:
    """``count`` waits whose steps get 0.4 s shorter each (a run's answers shrinking as
    it learns) on top of what the choice costs: ``lent_s`` or ``alone_s`` at the start."""
    shares, now = [], 0.0
    for i in range(count):
        when_pays.period_ends(now)
        share, _reason, measured = when_pays.next_wait()
        when_pays.period_begins(now, measured)
        shares.append(share)
        now += (lent_s if share else alone_s) - 0.4 * i
    return shares


def test_a_drift_over_the_run_does_not_decide_for_the_choice_measured_later() -> None:
    """Lending saves 1 s a step, but the steps shrink by 0.4 s each: measured once each,
    lend first, keep after, "alone" looks shorter by the drift of a block (3 x 0.4 s)
    and the rule would keep the slots. The bracket, lend / keep / lend with the mean of
    the two lending blocks, cancels the drift."""
    bracketed = WhenPays((1.0,), block_steps=3, reprobe_after=10, lend_margin=0.0, ewma_alpha=0.5)
    shares = drifting_waits(bracketed, 3 * 3 + 3, lent_s=20.0, alone_s=21.0)
    assert shares == [1.0] * 3 + [0.0] * 3 + [1.0] * 3 + [1.0] * 3
    assert bracketed.ruled == 1.0 and "lent <" in bracketed.switches[0].reason
    lent, alone = bracketed.periods[1.0].value, bracketed.periods[0.0].value
    assert lent is not None and alone is not None
    assert alone - lent == pytest.approx(1.0)  # the choice's cost, the drift cancelled


def test_a_re_measuring_block_is_bracketed_by_the_rule_s_choice() -> None:
    when_pays = rule(block_steps=1, reprobe_after=2)
    shares, now = waits(when_pays, 3, {0.0: 8.0, 1.0: 5.0}, 0.0)
    assert shares == [1.0, 0.0, 1.0]  # lend, keep, lend: the first choice is "lends"
    assert when_pays.ruled is None  # the bracket closes with the third block
    shares, _ = waits(when_pays, 4, {0.0: 8.0, 1.0: 5.0}, now)
    # the rule lends: two blocks alike, then keep to re-measure, then lend before deciding
    assert shares == [1.0, 0.0, 1.0, 1.0]
    assert when_pays.reprobe_interval == 4  # confirmed after the bracket: backed off
    assert [s.after for s in when_pays.switches] == [1.0]
