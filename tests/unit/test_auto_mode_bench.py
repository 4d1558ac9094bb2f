"""The verdict of ``loadtests/auto_mode.py``: auto against the best fixed mode, within
the spread between repeats of one mode."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import load_loadtest

auto_mode = load_loadtest("auto_mode")


def runs(**per_mode: list[float]) -> list[dict[str, Any]]:
    return [
        {"mode": mode, "status": "finished", "seconds_per_step": value}
        for mode, values in per_mode.items()
        for value in values
    ]


def test_auto_passes_within_the_noise_and_fails_beyond_it() -> None:
    within = auto_mode.verdict(
        runs(colocated=[1.0, 1.1], disaggregated=[0.8, 0.9], auto=[0.9, 0.92])
    )
    assert within["best_fixed"] == "disaggregated"
    assert within["noise"] == pytest.approx(0.1 / 0.85)  # disaggregated's spread, the largest
    assert within["auto_over_best"] == pytest.approx(0.91 / 0.85, abs=1e-3)
    assert within["passed"] is True
    beyond = auto_mode.verdict(runs(disaggregated=[0.8, 0.8], auto=[1.0, 1.0]))
    assert beyond["noise"] == 0.0 and beyond["passed"] is False
    # one repeat: no noise figure, no verdict; a failed run counts for nothing
    single = auto_mode.verdict(runs(multiplexed=[0.5], auto=[0.6]))
    assert single["noise"] is None and single["passed"] is None
    failed = [*runs(disaggregated=[0.8, 0.8]), {"mode": "auto", "status": "failed: x",
                                                "seconds_per_step": 0.1}]  # fmt: skip
    assert auto_mode.verdict(failed)["passed"] is None


def test_the_options_are_checked() -> None:
    args = auto_mode.parse_args(["--workloads", "toy", "--repeats", "1"])
    assert args.workload_list == ["toy"] and args.mode_list[-1] == "auto"
    for bad in (["--workloads", "nope"], ["--modes", "colocated"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            auto_mode.parse_args(bad)
