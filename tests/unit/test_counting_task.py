"""The built-in long-answer task "counting": its data, its teacher, its reward, and the
base model's build for it (tokenizer lengths, a loadable model)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from seamlessflow.rewards import get_reward
from seamlessflow.tasks import get_task_source, task_names
from seamlessflow.tasks.counting import (
    LEFT_RANGE,
    MAX_TOKENS,
    RIGHT_RANGE,
    CountingTask,
    operands,
    worked_answer,
)
from sf_app.base_model import (
    MODEL_SIZES,
    _build_hash,
    build_base_model,
    default_config,
    sized_config,
)


def test_counting_is_registered_with_its_budget_and_a_real_verifier() -> None:
    assert "counting" in task_names()
    source = get_task_source("counting", seed=3)
    assert isinstance(source, CountingTask)
    assert source.reward_fn == "math_answer" and source.max_tokens == MAX_TOKENS == 512


def test_splits_are_disjoint_deterministic_and_cover_every_pair() -> None:
    a, b = CountingTask(seed=1), CountingTask(seed=1)
    train, evaluation = a.items("train"), a.items("eval")
    assert train == b.items("train") and evaluation == b.items("eval")
    assert train != CountingTask(seed=2).items("train")
    ids = [item.task_id for item in train + evaluation]
    assert len(ids) == len(set(ids)) == len(LEFT_RANGE) * len(RIGHT_RANGE)
    assert len(evaluation) == int(len(ids) * 0.2)
    with pytest.raises(ValueError, match="unknown split"):
        a.items("test")


def test_the_worked_answer_counts_one_unit_per_line_and_the_verifier_takes_its_answer() -> None:
    text = worked_answer(37, 12)
    lines = text.split("\n")
    assert lines[0] == "37+12" and lines[1] == "38+11" and lines[-2] == "49+0"
    assert lines[-1] == "Answer: 49" and len(lines) == 12 + 2
    reward = get_reward("math_answer")
    assert reward(text, "49") == 1.0
    # the first number is the question's, not the answer: integer_match would be fooled
    assert reward("37+12\nAnswer: 48", "49") == 0.0
    # an answer cut before its "Answer:" line scores nothing (its last number is 0)
    assert reward(text.rsplit("\n", 1)[0], "49") == 0.0


def test_the_noisy_teacher_slips_by_whole_units_and_the_answer_shows_it() -> None:
    source = CountingTask(seed=0)
    reward = get_reward("math_answer")
    rng = random.Random(7)
    item = source.items("train")[0]
    a, b = operands(item)
    assert source.sft_completion(item, rng, 1.0) == worked_answer(a, b)
    wrong = 0
    for _ in range(200):
        text = source.sft_completion(item, rng, 0.9)
        lines = text.split("\n")
        assert len(lines) == b + 2  # a slip never changes the number of steps
        rights = [int(line.split("+")[1]) for line in lines[:-1]]
        assert rights == list(range(b, -1, -1))
        answer = int(lines[-1].removeprefix("Answer: "))
        assert answer == int(lines[-2].split("+")[0])  # the answer copies the last line
        wrong += reward(text, item.reference) == 0.0
    # each of b >= 10 steps right with p 0.9: right overall with p <= 0.9^10 ~ 0.35
    # (a slip of +2 and one of 0 can cancel, so a little more than that)
    assert 100 < wrong < 200


@pytest.fixture(scope="module")
def counting_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real build for "counting" with a short warm-up (its recipe otherwise)."""
    out = tmp_path_factory.mktemp("counting") / "base"
    return build_base_model(out, seed=0, sft_steps=4, task="counting")


def test_answers_are_60_to_512_tokens_with_the_built_tokenizer(counting_model: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(counting_model)
    source = CountingTask(seed=0)
    items = source.items("train") + source.items("eval")
    lengths = []
    for item in items:
        a, b = operands(item)
        # the answer and its stop token, as the engine generates them
        lengths.append(len(tokenizer.encode(worked_answer(a, b), add_special_tokens=False)) + 1)
    assert 60 <= min(lengths) and max(lengths) < MAX_TOKENS
    assert 200 <= sum(lengths) / len(lengths) <= 300
    info = json.loads((counting_model / "build_info.json").read_text())
    assert info["task"] == "counting" and 0.0 <= info["sampled_reward_after_sft"] <= 1.0
    # the check sampled only the recipe's subset of the eval split, at the task's budget
    assert info["config"]["check_prompts"] == default_config("counting").check_prompts > 0


def test_model_sizes_change_the_shape_only_and_the_arithmetic_key_is_unchanged() -> None:
    small, medium = sized_config("counting", "small"), sized_config("counting", "medium")
    assert small == default_config("counting")
    assert medium.hidden_size == 512 and medium.num_hidden_layers == 8
    # the task's recipe stays (teacher, noise, check); the warm-up is scaled to the size
    assert medium.teacher_p_correct == small.teacher_p_correct
    assert medium.max_position_embeddings == small.max_position_embeddings == 1024
    assert medium.sft_steps * medium.sft_batch_size < small.sft_steps * small.sft_batch_size
    assert set(MODEL_SIZES) == {"small", "medium"}
    assert _build_hash(small, 0, "counting") != _build_hash(medium, 0, "counting")
    # the new check_prompts field stays out of the key at its default: cached arithmetic
    # builds keep theirs (the value tests/unit/test_lookup_tool_task.py pins)
    assert _build_hash(default_config("arithmetic"), 0, "arithmetic") == "72a1addfcd0b8856"
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        sized_config("counting", "huge")


def test_the_medium_size_has_tens_of_millions_of_parameters(counting_model: Path) -> None:
    from transformers import AutoTokenizer

    from sf_app.base_model import build_model

    tokenizer = AutoTokenizer.from_pretrained(counting_model)
    model = build_model(sized_config("counting", "medium"), tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    assert 20_000_000 <= parameters <= 40_000_000
    assert model.config.num_hidden_layers == 8 and not model.config.tie_word_embeddings


def test_a_run_names_its_model_size_and_an_unknown_one_is_refused() -> None:
    from pydantic import ValidationError

    from sf_app.base_model import built_model_name
    from sf_app.run.config import RunConfig

    config = RunConfig(task="counting", model_size="medium")
    assert config.max_tokens == MAX_TOKENS  # the task's budget
    assert built_model_name("counting", "medium") == "base-counting-medium"
    assert built_model_name("counting", "small") == "base-counting"  # the cache as before
    with pytest.raises(ValidationError, match="unknown model size 'huge'"):
        RunConfig(model_size="huge")
