"""The deployment-modes benchmark (``seamlessflow bench --out``) writes a result that the
regression check (loadtests/regression.py) judges by its ratios, as for the TRL
comparison; the check as a command exits 1 on a drop. The check's verdicts in process
are tests/unit/test_bench_regression_ratios.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import LOADTESTS, load_loadtest
from tests.support.bench_results import RATIO, modes_result

MODES = ["colocated", "disaggregated"]
STEPS = 2
MACHINE_KEYS = {"cpu_count", "cpu_affinity", "platform", "python", "torch", "transformers"}


@pytest.fixture(scope="module")
def regression() -> ModuleType:
    return load_loadtest("regression")


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


@pytest.mark.integration  # child processes
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
