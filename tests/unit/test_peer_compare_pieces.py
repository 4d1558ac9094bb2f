"""The TRL comparison's pieces for a real model and task (loadtests/peer_compare.py,
`just peer-real`) as pure units: held-out accuracy by wall time (the time to the
accuracy target, evaluations taken off each side's clock), TRL's reward through our
scorer on an rg: task, left-padded sampling, the settings it refuses; and the committed
baseline of the regression check (loadtests/regression.py) is a complete result. The
comparison run end to end is tests/mesh/test_peer_compare.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO_ROOT, load_loadtest


@pytest.fixture(scope="module")
def regression() -> ModuleType:
    return load_loadtest("regression")


@pytest.fixture(scope="module")
def peer() -> ModuleType:
    return load_loadtest("peer_compare")


def test_the_committed_baseline_is_a_complete_result(regression: ModuleType) -> None:
    baseline = json.loads(regression.DEFAULT_BASELINE.read_text())
    assert {"cpu_count", "platform", "python", "torch", "trl"} <= baseline["machine"].keys()
    for name in regression.CHECKED:
        assert baseline["ratios"][name] > 0, name
    assert baseline["seamlessflow"]["steps"] == baseline["trl"]["steps"] > 0
    assert regression.compare(baseline, baseline).ok


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


def test_on_a_gpu_trl_generates_with_its_colocated_vllm_on_our_engines_share(
    peer: ModuleType, tmp_path: Path
) -> None:
    """TRL's real ``GRPOConfig`` takes the GPU race's settings (bf16 off: on a machine
    without CUDA, transformers refuses bf16 off the CPU); the CPU run stays on the CPU."""
    from sf_engine.settings import ENGINES_GPU_SHARE

    args = peer.parse_args(["--task", RG_TASK, "--model", "smollm2-135m-instruct"])
    assert args.device == "cpu"
    on_cpu = peer.grpo_config(args, str(tmp_path))
    assert on_cpu.use_cpu and not on_cpu.use_vllm
    args.device = "cuda"
    on_gpu = peer.grpo_config(args, str(tmp_path), bf16=False)
    assert not on_gpu.use_cpu and on_gpu.use_vllm and on_gpu.vllm_mode == "colocate"
    assert on_gpu.vllm_gpu_memory_utilization == ENGINES_GPU_SHARE
    assert on_gpu.num_generations == args.group_size  # the GRPO settings are kept


def test_the_gpu_race_is_refused_where_torch_sees_no_cuda(peer: ModuleType) -> None:
    import torch

    argv = ["--device", "cuda"]
    if torch.cuda.is_available():
        assert peer.parse_args(argv).device == "cuda"
    else:
        with pytest.raises(SystemExit):
            peer.parse_args(argv)


def test_the_gpu_runs_race_takes_settings_the_comparison_accepts(peer: ModuleType) -> None:
    """``gpu_run``'s ``trl_race`` part: its arguments parse (the device aside: this
    machine may have none), and its figures are read out of a real report (the
    committed baseline)."""
    gpu_run = load_loadtest("gpu_run")
    args = peer.parse_args(list(gpu_run.TRL_RACE))
    assert (args.engines, args.eval_every, args.max_tokens) == (["vllm"], 10, 64)
    assert args.task.startswith("rg:basic_arithmetic")
    report = json.loads((REPO_ROOT / "loadtests/baselines/peer_compare.json").read_text())
    race = gpu_run.race_figures(report)
    for side in ("seamlessflow", "trl"):
        assert race[side]["steps_per_s"] == report[side]["steps_per_s"] > 0
    assert race["seamlessflow"]["mean_step_s"] == report["seamlessflow"]["mean_step_s"]
    assert race["ratios"] == report["ratios"]
