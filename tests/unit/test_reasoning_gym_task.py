"""reasoning-gym datasets as task sources (``seamlessflow.tasks.reasoning_gym``) and their
rewards (``seamlessflow.rewards.reasoning_gym_verifier``): names and their errors, seeded
disjoint splits, and rewards checked against reasoning-gym's own generators and scorers."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from typing import Any

import pytest
from reasoning_gym.factory import create_dataset

from seamlessflow.plugins import UnknownPlugin
from seamlessflow.rewards import get_reward, reasoning_gym_accuracy, reasoning_gym_reward
from seamlessflow.rewards.reasoning_gym_verifier import (
    RgReference,
    build_dataset,
    decode_value,
    encode_value,
    extract_answer,
    stated_in_format,
)
from seamlessflow.tasks import TASKS, TaskItem, get_task_source
from seamlessflow.tasks.reasoning_gym import (
    DEFAULT_ANSWER_FORMAT,
    DEFAULT_EVAL_SIZE,
    DEFAULT_SIZE,
    SYSTEM_PROMPTS,
    ReasoningGymTask,
    parse_rg_task_name,
    split_seed,
)
from sf_trajectory.schedule import build_stages, parse_stages

SEED = 11


def rg_source(name: str, seed: int = SEED) -> ReasoningGymTask:
    source = get_task_source(name, seed=seed)
    assert isinstance(source, ReasoningGymTask)
    return source


def original_entry(
    dataset: str, item: TaskItem, seed: int, size: int, **config: Any
) -> dict[str, Any]:
    """The entry reasoning-gym itself generates for ``item`` (its split's seed, its index)."""
    *_, split, index = item.task_id.rsplit("-", 2)
    generated = create_dataset(dataset, seed=split_seed(seed, split), size=size, **config)
    return generated[int(index)]


def tagged(answer: str) -> str:
    return f"Let me work it out.\n<answer>{answer}</answer>"


# ------------------------------------------------------------------ names and errors


def test_an_rg_name_is_parsed_into_the_dataset_its_options_and_ours() -> None:
    assert parse_rg_task_name("arithmetic") is None
    spec = parse_rg_task_name(
        "rg:basic_arithmetic?max_digits=2&operators=+,-&size=50&eval_size=10"
        "&answer=last_line&max_tokens=64"
    )
    assert spec is not None and spec.dataset == "basic_arithmetic"
    assert spec.config == {"max_digits": "2", "operators": "+,-"}  # a "+" stays a plus
    assert (spec.size, spec.eval_size, spec.answer_format) == (50, 10, "last_line")
    assert (spec.format_reward, spec.max_tokens) == (0.0, 64)
    default = parse_rg_task_name("rg:chain_sum")
    assert default is not None and default.config == {}
    assert (default.size, default.eval_size) == (DEFAULT_SIZE, DEFAULT_EVAL_SIZE)
    assert (default.answer_format, default.format_reward, default.max_tokens) == (
        DEFAULT_ANSWER_FORMAT,
        0.0,
        None,
    )
    escaped = parse_rg_task_name("rg:basic_arithmetic?operators=%2B%2C-")
    assert escaped is not None and escaped.config == {"operators": "+,-"}


def test_the_dataset_options_become_its_configuration() -> None:
    dataset = build_dataset(
        "basic_arithmetic",
        {
            "max_digits": "2",
            "operators": "+,-",
            "allow_parentheses": "false",
            "format_style": "natural",
        },
        seed=1,
        size=3,
    )
    config = dataset.config
    assert config.max_digits == 2 and config.operators == ("+", "-")
    assert config.allow_parentheses is False and config.format_style == "natural"
    dates = build_dataset("time_intervals", {"min_date": "2020-01-02"}, seed=1, size=1)
    assert dates.config.min_date == datetime.date(2020, 1, 2)
    optional = build_dataset("figlet_font", {"static_word": "none"}, seed=1, size=1)
    assert optional.config.static_word is None
    weights = build_dataset("aiw", {"task_type_weights": "0.5,0.25,0.25"}, seed=1, size=1)
    assert weights.config.task_type_weights == [0.5, 0.25, 0.25]


@pytest.mark.parametrize(
    ("name", "mentions"),
    [
        ("rg:basic_arithmetic?max_digts=2", ["max_digts", "max_digits", "min_terms", "size"]),
        ("rg:basic_arithmetic?max_digits=two", ["max_digits", "integer", "min_terms"]),
        ("rg:basic_arithmetic?min_digits=3&max_digits=2", ["max_digits must be >= min_digits"]),
        ("rg:basic_arithmetic?format_style=fancy", ["natural", "simple", "max_digits"]),
        ("rg:basic_arithmetic?allow_negation=maybe", ["true or false"]),
        ("rg:basic_arithmetic?operators=+,%", ["unsupported operator"]),
        ("rg:rearc?rng_difficulty_ranges=1", ["cannot be set from a task name"]),
        ("rg:chain_sum?seed=3", ["seed", "run's seed"]),
        ("rg:chain_sum?size=0", ["size", ">= 1"]),
        ("rg:chain_sum?eval_size=-1", ["eval_size"]),
        ("rg:chain_sum?answer=json", ["tag", "last_line", "last_number"]),
        ("rg:chain_sum?format_reward=1", ["[0, 1)"]),
        ("rg:chain_sum?format_reward=much", ["[0, 1)"]),
        ("rg:chain_sum?answer=last_line&format_reward=0.1", ["answer=tag"]),
        ("rg:chain_sum?max_tokens=0", ["max_tokens"]),
        ("rg:chain_sum?size=5&size=6", ["twice"]),
        ("rg:chain_sum?size", ["key=value"]),
        ("rg:", ["dataset"]),
    ],
)
def test_a_bad_name_fails_when_the_source_is_built_and_says_why(
    name: str, mentions: list[str]
) -> None:
    with pytest.raises(ValueError) as refused:
        get_task_source(name, seed=SEED)
    for text in mentions:
        assert text in str(refused.value), (text, str(refused.value))


def test_an_unknown_dataset_names_the_closest_ones() -> None:
    with pytest.raises(UnknownPlugin, match="basic_arithmetic"):
        get_task_source("rg:basic_arithmetc")
    with pytest.raises(UnknownPlugin, match="unknown reasoning-gym dataset 'nope'"):
        get_task_source("rg:nope")
    with pytest.raises(UnknownPlugin) as unknown_task:
        get_task_source("no-such-task")
    assert "rg:DATASET" in str(unknown_task.value)  # the prefix is listed with the tasks


def test_max_tokens_is_the_task_s_only_when_its_name_gives_one() -> None:
    assert not hasattr(rg_source("rg:chain_sum?size=5"), "max_tokens")
    assert rg_source("rg:chain_sum?size=5&max_tokens=96").max_tokens == 96


def test_the_rewards_are_registered_and_reasoning_gym_is_imported_only_when_used() -> None:
    source = rg_source("rg:chain_sum?size=5")
    assert get_reward(source.reward_fn) is reasoning_gym_reward
    assert get_reward(source.eval_reward_fn) is reasoning_gym_accuracy
    code = (
        "import sys, seamlessflow.rewards, seamlessflow.tasks\n"
        "from seamlessflow.rewards import reward_names\n"
        "assert 'reasoning_gym' in reward_names(), reward_names()\n"
        "assert 'reasoning_gym' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ items and splits


def test_items_are_reasoning_gym_s_own_entries_with_a_prompt_stating_the_format() -> None:
    for answer_format in ("tag", "last_line"):
        source = rg_source(f"rg:leg_counting?max_animals=4&size=6&answer={answer_format}")
        for item in source.items("train"):
            entry = original_entry("leg_counting", item, SEED, 6, max_animals=4)
            system, user = item.messages
            assert system == {"role": "system", "content": SYSTEM_PROMPTS[answer_format]}
            assert user == {"role": "user", "content": entry["question"]}
            reference = RgReference.from_json(item.reference)
            assert reference.answer == entry["answer"]
            assert reference.config == {"max_animals": "4"}
            assert reference.answer_format == answer_format
    assert "<answer>" in SYSTEM_PROMPTS["tag"] and "last line" in SYSTEM_PROMPTS["last_line"]


def test_splits_are_deterministic_for_a_seed_and_disjoint() -> None:
    name = "rg:chain_sum?size=60&eval_size=20"
    first, again, other = rg_source(name), rg_source(name), rg_source(name, seed=SEED + 1)
    for split in ("train", "eval"):
        assert first.items(split) == again.items(split)
        assert first.items(split) != other.items(split)
    for source in (first, other):
        train, held_out = source.items("train"), source.items("eval")
        train_questions = [item.messages[-1]["content"] for item in train]
        eval_questions = [item.messages[-1]["content"] for item in held_out]
        assert not set(train_questions) & set(eval_questions)
        assert len(set(train_questions)) == len(train_questions)
        ids = [item.task_id for item in train + held_out]
        assert len(set(ids)) == len(ids)
    with pytest.raises(ValueError, match="unknown split"):
        first.items("test")


def test_questions_the_eval_split_holds_are_dropped_from_train() -> None:
    """A small question space: the generators repeat questions; no split repeats one and
    train holds none of eval's."""
    options = "min_terms=2&max_terms=2&max_digits=1&allow_negation=false"
    source = rg_source(f"rg:chain_sum?{options}&size=200&eval_size=40")
    train, held_out = source.items("train"), source.items("eval")
    eval_questions = {item.messages[-1]["content"] for item in held_out}
    generated = create_dataset(
        "chain_sum",
        seed=split_seed(SEED, "train"),
        size=200,
        min_terms=2,
        max_terms=2,
        max_digits=1,
        allow_negation=False,
    )
    all_train_questions = [generated[i]["question"] for i in range(200)]
    assert set(all_train_questions) & eval_questions  # the generator did repeat them
    kept = {item.messages[-1]["content"] for item in train}
    assert kept == set(all_train_questions) - eval_questions
    assert len(train) == len(kept) < 200


def test_an_eval_size_of_zero_holds_nothing_out() -> None:
    source = rg_source("rg:chain_sum?size=10&eval_size=0")
    assert source.items("eval") == [] and len(source.items("train")) > 0


# ------------------------------------------------------------------ rewards


@pytest.mark.parametrize(
    ("dataset", "config"),
    [
        ("basic_arithmetic", {"max_digits": 2}),
        ("chain_sum", {}),
        ("countdown", {}),
        ("leg_counting", {}),
        ("gsm_symbolic", {}),
        ("word_sorting", {}),
    ],
)
def test_the_rewards_are_the_dataset_s_own_scorer(dataset: str, config: dict[str, Any]) -> None:
    """A right answer in the stated format scores 1; a wrong one what reasoning-gym's
    scorer gives it (less than 1); each the same through the reference's JSON."""
    options = "&".join(f"{k}={v}" for k, v in config.items())
    source = rg_source(f"rg:{dataset}?size=6&{options}")
    scorer = create_dataset(dataset, seed=0, size=1, **config)
    for item in source.items("train"):
        entry = original_entry(dataset, item, SEED, 6, **config)
        right, wrong = entry["answer"], f"7{entry['answer']}7"
        assert scorer.score_answer(right, entry) == 1.0
        assert reasoning_gym_reward(tagged(right), item.reference) == 1.0
        assert reasoning_gym_accuracy(tagged(right), item.reference) == 1.0
        wrong_score = scorer.score_answer(wrong, entry)
        assert wrong_score < 1.0
        assert reasoning_gym_reward(tagged(wrong), item.reference) == wrong_score
        assert reasoning_gym_accuracy(tagged(wrong), item.reference) == wrong_score
        assert reasoning_gym_reward(right, item.reference) == scorer.score_answer(None, entry)


def test_the_format_term_rewards_the_stated_format_and_the_eval_reward_ignores_it() -> None:
    weight = 0.2
    source = rg_source(f"rg:chain_sum?size=5&format_reward={weight}")
    scorer = create_dataset("chain_sum", seed=0, size=1)
    for item in source.items("train"):
        entry = original_entry("chain_sum", item, SEED, 5)
        right = entry["answer"]
        wrong = str(int(right) + 1)
        wrong_score = scorer.score_answer(wrong, entry)
        no_answer_score = scorer.score_answer(None, entry)
        cases = {
            tagged(right): (1.0, True),
            f"<answer>{right}</answer> and that is all": (1.0, False),  # text after it
            f"<answer>{wrong}</answer><answer>{right}</answer>": (1.0, False),  # two answers
            tagged(wrong): (wrong_score, True),
            f"The answer is {right}.": (no_answer_score, False),  # no tag
        }
        for completion, (score, formatted) in cases.items():
            expected = (1 - weight) * score + weight * float(formatted)
            assert math.isclose(reasoning_gym_reward(completion, item.reference), expected)
            assert reasoning_gym_accuracy(completion, item.reference) == score


def test_the_last_line_is_the_answer_when_the_task_says_so() -> None:
    source = rg_source("rg:chain_sum?size=5&answer=last_line")
    scorer = create_dataset("chain_sum", seed=0, size=1)
    for item in source.items("train"):
        entry = original_entry("chain_sum", item, SEED, 5)
        right = entry["answer"]
        assert reasoning_gym_reward(f"Adding up:\n  {right}  \n\n", item.reference) == 1.0
        assert reasoning_gym_reward(f"{right}\nwait, no", item.reference) == (
            scorer.score_answer("wait, no", entry)
        )
        assert reasoning_gym_accuracy("", item.reference) == scorer.score_answer(None, entry)


@pytest.mark.parametrize(
    ("completion", "answer_format", "answer", "formatted"),
    [
        ("<answer>42</answer>", "tag", "42", True),
        ("reasoning...\n<answer>\n  42 \n</answer>\n", "tag", "42", True),
        ("<answer>1</answer> then <answer>2</answer>", "tag", "2", False),
        ("<answer>1</answer> then <answer>2", "tag", "1", False),  # the last one is unclosed
        ("<answer> <answer>5</answer>", "tag", "5", False),
        ("<answer></answer>", "tag", "", False),
        ("the answer is 42", "tag", None, False),
        ("42</answer>", "tag", None, False),
        ("<ANSWER>42</ANSWER>", "tag", None, False),
        ("work\n\n  42  \n \n", "last_line", "42", True),
        ("<answer>42</answer>", "last_line", "<answer>42</answer>", True),
        ("  \n ", "last_line", None, False),
        ("7 + 12 = 19, so the answer is 19.", "last_number", "19", False),
        ("work: 3 - 10\n-7", "last_number", "-7", True),
        ("about 1,234.5 of them\n1,234.5", "last_number", "1234.5", True),
        ("12,34 and 5", "last_number", "5", False),
        ("no digits here", "last_number", None, False),
    ],
)
def test_how_the_answer_is_read(
    completion: str, answer_format: str, answer: str | None, formatted: bool
) -> None:
    assert extract_answer(completion, answer_format) == answer
    assert stated_in_format(completion, answer_format) is formatted


def test_a_scorer_that_fails_on_an_answer_scores_it_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing:
        def score_answer(self, answer: str | None, entry: dict[str, Any]) -> float:
            raise IndexError("a scorer's own bug")

    import seamlessflow.rewards.reasoning_gym_verifier as verifier

    monkeypatch.setattr(verifier, "scoring_dataset", lambda dataset, config: Failing())
    item = rg_source("rg:chain_sum?size=2").items("train")[0]
    assert reasoning_gym_reward(tagged("3"), item.reference) == 0.0


@pytest.mark.parametrize(
    "reference",
    ["", "42", "[]", json.dumps({"dataset": "chain_sum"}), '{"dataset": 1, "config": {}}'],
)
def test_a_malformed_reference_is_an_error_not_a_score(reference: str) -> None:
    with pytest.raises(ValueError, match="reasoning-gym reference"):
        reasoning_gym_reward(tagged("1"), reference)


# ------------------------------------------------------------------ the reference's JSON


@pytest.mark.parametrize(
    "dataset",
    [
        "basic_arithmetic",
        "chain_sum",
        "countdown",
        "leg_counting",
        "gsm_symbolic",
        "propositional_logic",
        "arc_1d",
        "time_intervals",
        "knights_knaves",
    ],
)
def test_the_reference_carries_the_entry_through_json_unchanged(dataset: str) -> None:
    source = rg_source(f"rg:{dataset}?size=4&eval_size=2")
    items = source.items("train") + source.items("eval")
    scorer = create_dataset(dataset, seed=0, size=1)
    for item in items:
        entry = original_entry(dataset, item, SEED, 4 if "-train-" in item.task_id else 2)
        reference = RgReference.from_json(item.reference)
        assert reference.dataset == dataset
        assert reference.entry() == {"answer": entry["answer"], "metadata": entry["metadata"]}
        assert RgReference.from_json(reference.to_json()) == reference
        candidates = ["", "no idea", str(entry["answer"])]
        candidates += [str(entry["metadata"].get("example_answer", "x"))]
        for candidate in candidates:
            expected = scorer.score_answer(candidate, entry)
            assert reasoning_gym_accuracy(tagged(candidate), item.reference) == expected


def test_the_json_keeps_python_shapes_the_scorers_compare() -> None:
    value = {
        "grid": ((1, 2), (3, 4)),
        "cells": {(0, 1): "a", 2: [1.5, None, True]},
        "seen": {3, 1},
        "frozen": frozenset({"x"}),
        "__tuple__": [1],  # a key that looks like a tag
        "nan": float("nan"),
    }
    decoded = decode_value(json.loads(json.dumps(encode_value(value))))
    assert decoded == {**value, "nan": "nan"}
    assert isinstance(decoded["grid"][0], tuple) and isinstance(decoded["frozen"], frozenset)
    assert decode_value(json.loads(json.dumps(encode_value({"__set__": [1]})))) == {"__set__": [1]}


# ------------------------------------------------------------------ stages and evaluation


def test_two_reasoning_gym_stages_parse_and_build() -> None:
    specs = parse_stages(
        "rg:basic_arithmetic?max_digits=2&operators=%2B%2C-&size=30:20,rg:chain_sum?size=10"
    )
    assert [(spec.task, spec.batches) for spec in specs] == [
        ("rg:basic_arithmetic?max_digits=2&operators=%2B%2C-&size=30", 20),
        ("rg:chain_sum?size=10", None),
    ]
    first, second = build_stages(specs, seed=SEED)
    assert (first.first_batch, second.first_batch) == (0, 20)
    assert first.reward_fn == second.reward_fn == "reasoning_gym"
    assert {RgReference.from_json(i.reference).dataset for i in first.items} == {"basic_arithmetic"}
    assert {RgReference.from_json(i.reference).dataset for i in second.items} == {"chain_sum"}
    assert RgReference.from_json(first.items[0].reference).config == {
        "max_digits": "2",
        "operators": "+,-",
    }
    assert not {i.task_id for i in first.items} & {i.task_id for i in second.items}
    assert [(s.task, s.batches) for s in parse_stages("rg:chain_sum:5,rg:leg_counting")] == [
        ("rg:chain_sum", 5),
        ("rg:leg_counting", None),
    ]


def test_the_trainer_s_held_out_evaluation_reports_the_accuracy() -> None:
    from sf_trainer.evaluation import EvalSet
    from sf_trainer.settings import TrainerSettings

    task = "rg:chain_sum?size=10&eval_size=8&format_reward=0.3"
    settings = TrainerSettings(eval_every=1, eval_task=task, eval_items=5)
    eval_set = EvalSet.from_settings(settings, seed=SEED)
    assert eval_set.reward_fn == "reasoning_gym_accuracy"
    assert eval_set.items == rg_source(task).items("eval")[:5]
    builtin = EvalSet.from_settings(TrainerSettings(eval_every=1, eval_task="arithmetic"), 0)
    assert builtin.reward_fn == get_task_source("arithmetic").reward_fn  # no eval_reward_fn
    assert "rg:" in TASKS.hint


def test_the_last_number_is_the_answer_when_the_task_says_so() -> None:
    source = rg_source("rg:chain_sum?size=5&answer=last_number&format_reward=0.2")
    for item in source.items("train"):
        entry = original_entry("chain_sum", item, SEED, 5)
        right = entry["answer"]
        worked = f"First 3 + 4 = 7, then the total is {right}."
        assert reasoning_gym_accuracy(worked, item.reference) == 1.0
        # the format term: the number alone on the last line
        assert math.isclose(reasoning_gym_reward(worked, item.reference), 0.8)
        assert reasoning_gym_reward(f"Adding up:\n{right}", item.reference) == 1.0
        wrong = str(int(right) + 1)
        assert reasoning_gym_accuracy(f"{right} or maybe {wrong}", item.reference) < 1.0
