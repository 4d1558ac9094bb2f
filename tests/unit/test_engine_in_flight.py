"""The engine worker's record of its requests in flight (`sf_engine.in_flight.InFlight`):
the youngest first for a rebalance, ``empty`` for a release, busy time for a lend."""

from __future__ import annotations

import time

import pytest

from sf_engine.in_flight import InFlight


def test_the_youngest_are_the_most_recently_started_and_empty_follows_the_count() -> None:
    flight = InFlight()
    assert flight.empty.is_set() and len(flight) == 0
    for request_id in ("a", "b", "c"):
        flight.add(request_id)
    assert not flight.empty.is_set() and len(flight) == 3
    assert flight.youngest(2) == ["c", "b"]
    assert flight.youngest(10) == ["c", "b", "a"]
    assert flight.youngest(0) == flight.youngest(-1) == []
    flight.discard("b")
    flight.discard("never-added")  # a reply for a request already discarded
    assert flight.youngest(3) == ["c", "a"]
    flight.discard("a")
    flight.discard("c")
    assert flight.empty.is_set() and len(flight) == 0


def test_busy_time_counts_only_while_a_request_runs_and_restarts_on_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    flight = InFlight()
    now[0] += 5  # idle: not counted
    flight.add("a")
    now[0] += 2
    flight.add("b")
    now[0] += 1
    assert flight.busy_seconds() == pytest.approx(3.0)  # running, counted so far
    flight.discard("a")
    flight.discard("b")
    now[0] += 10  # idle again
    assert flight.busy_seconds() == pytest.approx(3.0)
    flight.add("c")
    now[0] += 4
    flight.reset_busy()  # joined the queue again: counting starts now, "c" still running
    now[0] += 1
    assert flight.busy_seconds() == pytest.approx(1.0)
    flight.discard("c")
    flight.reset_busy()
    now[0] += 3
    assert flight.busy_seconds() == 0.0
