"""The regression check (loadtests/regression.py) on results of the deployment-modes
benchmark (``seamlessflow bench --out``), in process: a modes ratio passes within the
tolerance and fails beyond it, a missing ratio is a regression and a new one a note, and
machine differences are notes. The benchmark itself and the check as a command are
tests/mesh/test_bench_regression.py."""

from __future__ import annotations

import copy
from types import ModuleType
from typing import Any

import pytest

from tests.support import load_loadtest
from tests.support.bench_results import RATIO, modes_result


@pytest.fixture(scope="module")
def regression() -> ModuleType:
    return load_loadtest("regression")


def test_a_modes_ratio_passes_within_the_tolerance_and_fails_beyond_it(
    regression: ModuleType,
) -> None:
    baseline = modes_result(**{RATIO: 0.9, "multiplexed_steps_per_s_vs_colocated": 0.75})
    tolerance = 0.4

    def scaled(factor: float) -> dict[str, Any]:
        result = copy.deepcopy(baseline)
        result["ratios"][RATIO] *= factor
        return result

    assert regression.compare(baseline, baseline, tolerance).ok
    within = regression.compare(baseline, scaled(1 - tolerance / 2), tolerance)
    assert within.ok, within.regressions
    assert regression.compare(baseline, scaled(2.0), tolerance).ok  # faster is fine
    # a modes ratio is a rate: the wider time tolerance does not apply to it
    beyond = regression.compare(baseline, scaled(1 - 1.5 * tolerance), tolerance, 0.9)
    [line] = beyond.regressions
    assert line.startswith(f"{RATIO}: ratio ") and "baseline 0.900" in line


def test_a_missing_modes_ratio_is_a_regression_and_a_new_one_a_note(
    regression: ModuleType,
) -> None:
    baseline = modes_result(**{RATIO: 0.9, "multiplexed_steps_per_s_vs_colocated": 0.75})
    without_multiplexed = modes_result(**{RATIO: 0.9})
    verdict = regression.compare(baseline, without_multiplexed)
    assert [line.split(":")[0] for line in verdict.regressions] == [
        "multiplexed_steps_per_s_vs_colocated"
    ]

    verdict = regression.compare(without_multiplexed, baseline)
    assert verdict.ok
    assert any(note.startswith("multiplexed_steps_per_s_vs_colocated") for note in verdict.notes)


def test_machine_differences_are_notes_on_the_keys_both_descriptions_have(
    regression: ModuleType,
) -> None:
    baseline = modes_result(**{RATIO: 0.9})
    baseline["machine"] |= {"trl": "1.16.0", "loadavg_at_start": [0.1, 0.2, 0.3]}
    current = copy.deepcopy(baseline)
    del current["machine"]["trl"]  # a modes result has no TRL version
    current["machine"] |= {"cpu_count": 8, "loadavg_at_start": [3.0, 2.0, 1.0]}
    verdict = regression.compare(baseline, current)
    assert verdict.ok
    assert verdict.notes == ["machine cpu_count differs: baseline 2, now 8"]
