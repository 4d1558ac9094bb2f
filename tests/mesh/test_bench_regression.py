"""The deployment-modes benchmark (``seamlessflow bench --out``) writes a result that the
regression check (loadtests/regression.py) judges by its ratios, as for the TRL
comparison."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import LOADTESTS, load_loadtest

MODES = ["colocated", "disaggregated"]
STEPS = 2
RATIO = "disaggregated_steps_per_s_vs_colocated"
MACHINE_KEYS = {"cpu_count", "cpu_affinity", "platform", "python", "torch", "transformers"}


@pytest.fixture(scope="module")
def regression() -> ModuleType:
    return load_loadtest("regression")


def modes_result(**ratios: float) -> dict[str, Any]:
    """A ``seamlessflow bench --out`` result with these ratios (figures left out: the
    check reads only the machine and the ratios)."""
    return {
        "machine": {"cpu_count": 2, "platform": "Linux-test", "python": "3.11.7"},
        "settings": {"steps": 60, "modes": ["colocated", "disaggregated", "multiplexed"]},
        "modes": [],
        "ratios": dict(ratios),
    }


@pytest.mark.slow
def test_bench_writes_the_modes_their_ratios_and_the_machine(
    base_model_dir: Path, tmp_path: Path, regression: ModuleType
) -> None:
    out = tmp_path / "load" / "modes.json"
    command = [sys.executable, "-m", "sf_app", "bench", "--steps", str(STEPS)]
    command += ["--modes", ",".join(MODES), "--model-dir", str(base_model_dir)]
    command += ["--runs-dir", str(tmp_path / "runs"), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

    report = json.loads(out.read_text())
    assert MACHINE_KEYS <= report["machine"].keys()
    assert report["machine"]["cpu_count"] >= 1 and "trl" not in report["machine"]
    assert report["settings"] == {
        "steps": STEPS,
        "modes": MODES,
        "task": "arithmetic",
        "agent": "single_turn",
        "pin_slots": False,
        "max_tokens": None,
        "model_dir": str(base_model_dir),
    }
    assert [figures["mode"] for figures in report["modes"]] == MODES
    for figures in report["modes"]:
        assert figures["status"] == "finished", figures
        assert figures["steps"] == STEPS, figures
        assert Path(tmp_path / "runs" / figures["run_id"], "summary.json").exists()
    # the ratio is the one printed with the disaggregated figures; the first mode has none
    assert report["ratios"] == {RATIO: report["modes"][1]["steps_per_s_vs_colocated"]}
    assert report["ratios"][RATIO] > 0
    assert json.loads(result.stdout) == report["modes"]  # still printed as before

    assert regression.main([str(out), "--baseline", str(out)]) == 0


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


def test_the_regression_command_exits_1_on_a_modes_drop(
    regression: ModuleType, tmp_path: Path
) -> None:
    paths = {}
    for name, ratio in (("baseline", 0.9), ("slower", 0.3), ("same", 0.9)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(modes_result(**{RATIO: ratio})))
    command = [sys.executable, str(LOADTESTS / "regression.py"), str(paths["slower"])]
    command += ["--baseline", str(paths["baseline"])]
    failed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "REGRESSION" in failed.stderr and RATIO in failed.stderr

    command[2] = str(paths["same"])
    passed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "OK: no ratio dropped by more than 40%" in passed.stdout

    command[-1] = str(tmp_path / "no-baseline.json")  # nothing compared: not a pass
    missing = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert missing.returncode == 2 and "no-baseline.json" in missing.stderr
