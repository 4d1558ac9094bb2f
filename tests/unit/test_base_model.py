"""The built-in task, the reward registry, and the locally built tokenizer and base model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from seamlessflow.plugins import UnknownPlugin
from seamlessflow.rewards import get_reward, integer_match, register_reward
from seamlessflow.tasks import get_task_source
from sf_app.base_model import (
    IM_END,
    TOOL_CALL,
    build_base_model,
    ensure_base_model,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            },
        },
    }
]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 12}}}
# What the model emits for the assistant turn that makes CALL.
CALL_COMPLETION = '<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 12}}\n</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 7 + 12?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "19"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "19"},
    {"role": "user", "content": "And 1 + 2?"},
    {"role": "assistant", "content": "The answer is 3"},
]


@pytest.mark.parametrize(
    ("completion", "reference", "expected"),
    [
        ("19", "19", 1.0),
        ("  19 \n", "19", 1.0),
        ("The answer is 19.", "19", 1.0),
        ("19 or 20", "19", 1.0),
        ("20", "19", 0.0),
        ("190", "19", 0.0),
        ("20, not 19", "19", 0.0),
        ("-19", "19", 0.0),
        ("#$%19abc", "19", 1.0),
        ("no number here", "19", 0.0),
        ("", "19", 0.0),
        ("\ufffd\x00 garbage", "0", 0.0),
    ],
)
def test_integer_match(completion: str, reference: str, expected: float) -> None:
    assert integer_match(completion, reference) == expected


def test_get_reward_by_name_and_dotted_path() -> None:
    assert get_reward("integer_match") is integer_match
    assert get_reward("seamlessflow.rewards:integer_match") is integer_match
    assert get_reward("seamlessflow.rewards.integer_match") is integer_match
    with pytest.raises(UnknownPlugin, match="integer_match"):
        get_reward("no_such_reward")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("integer_match")(lambda completion, reference: 0.0)


def test_task_is_deterministic_with_disjoint_splits() -> None:
    task = get_task_source("arithmetic", seed=0)
    assert task.name == "arithmetic"
    assert get_reward(task.reward_fn) is integer_match
    train, evaluation = task.items("train"), task.items("eval")
    assert train == get_task_source("arithmetic", seed=0).items("train")
    assert train != get_task_source("arithmetic", seed=1).items("train")
    assert len(train) + len(evaluation) >= 300
    train_ids, eval_ids = {i.task_id for i in train}, {i.task_id for i in evaluation}
    assert len(train_ids) == len(train) and len(eval_ids) == len(evaluation)
    assert not train_ids & eval_ids
    prompts = {m["content"] for i in train for m in i.messages}
    assert not prompts & {m["content"] for i in evaluation for m in i.messages}
    item = train[0]
    a, b = (int(x) for x in item.task_id.split("-")[1:])
    assert item.messages == ({"role": "user", "content": f"What is {a} + {b}?"},)
    assert integer_match(str(a + b), item.reference) == 1.0
    with pytest.raises(ValueError, match="split"):
        task.items("test")
    with pytest.raises(UnknownPlugin, match="arithmetic"):
        get_task_source("no_such_task")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_base_model(tmp_path_factory.mktemp("base") / "model", seed=0, sft_steps=8)


def test_build_loads_back_untied(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert model.config.tie_word_embeddings is False
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed.data_ptr() != head.data_ptr() and not torch.equal(embed, head)
    assert model.config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert tokenizer.padding_side == "left"
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == "<|endoftext|>"
    info = json.loads((model_dir / "build_info.json").read_text())
    assert info["seed"] == 0 and info["sft_steps"] == 8
    assert 0.0 <= info["sampled_reward_after_sft"] <= 1.0
    assert info["vocab_size"] == len(tokenizer) == model.config.vocab_size


def test_ensure_base_model_reuses_a_matching_build(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert ensure_base_model(model_dir, seed=0, sft_steps=8) == model_dir
    assert weights.stat().st_mtime_ns == before


def test_chat_template_is_prefix_stable(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    im_end = tokenizer.encode(IM_END + "\n", add_special_tokens=False)
    for tools in (None, TOOLS):
        for k, message in enumerate(CONVERSATION):
            if message["role"] != "assistant":
                continue
            completion = message["content"] or CALL_COMPLETION
            prompt = tokenizer.apply_chat_template(
                CONVERSATION[:k], tools=tools, add_generation_prompt=True, tokenize=False
            )
            full = tokenizer.apply_chat_template(CONVERSATION[: k + 1], tools=tools, tokenize=False)
            assert prompt + completion + IM_END + "\n" == full
            prompt_ids = tokenizer.apply_chat_template(
                CONVERSATION[:k], tools=tools, add_generation_prompt=True, return_dict=False
            )
            full_ids = tokenizer.apply_chat_template(
                CONVERSATION[: k + 1], tools=tools, return_dict=False
            )
            completion_ids = tokenizer.encode(completion, add_special_tokens=False)
            assert prompt_ids + completion_ids + im_end == full_ids


def test_tokenizer_round_trips_a_tool_call_conversation(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False)
    assert CALL_COMPLETION in text and '"name": "add"' in text
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    # <tool_call> is one token and survives skip_special_tokens; the chat markers do not.
    assert ids.count(tokenizer.convert_tokens_to_ids(TOOL_CALL)) == text.count(TOOL_CALL) > 0
    stripped = tokenizer.decode(ids, skip_special_tokens=True)
    assert CALL_COMPLETION in stripped and IM_END not in stripped
    # AutoTokenizer picks the class from the model type; it must tokenize as the file says.
    plain = PreTrainedTokenizerFast.from_pretrained(model_dir)
    assert plain.encode(text, add_special_tokens=False) == ids
