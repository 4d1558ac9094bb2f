"""The session prefix tree with the real chat template and tokenizer of the base model.
A template that rewrites a reply (Qwen3's) is
tests/unit/test_conversation_rewritten_reply.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sf_gateway.conversation import Conversation, normalize_message
from tests.support.token_texts import engine_output


@pytest.fixture(scope="module")
def tokenizer(base_model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(base_model_dir))


@pytest.fixture
def conversation(tokenizer) -> Conversation:  # type: ignore[no-untyped-def]
    def render(messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        return str(
            tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation
            )
        )

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    return Conversation(render=render, encode=encode, end_of_turn="<|im_end|>")


def answer(conversation, tokenizer, messages, text, tools=None, **kw):  # type: ignore[no-untyped-def]
    prompt = conversation.prompt_for(messages, tools)
    completion = engine_output(tokenizer, text, **kw)
    reply = {"role": "assistant", "content": text}
    conversation.record(
        messages, tools, reply, prompt.ids, completion, tokenizer.decode(completion)
    )
    return prompt, completion, reply


def test_a_new_turn_reuses_the_exact_ids_of_the_previous_ones(conversation, tokenizer) -> None:  # type: ignore[no-untyped-def]
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    # the engine spelled its answer in a non-canonical way: one token per character
    prompt1, completion1, reply1 = answer(
        conversation, tokenizer, first, "four or 4", char_by_char=True
    )
    second = [*first, reply1, {"role": "user", "content": "And 3 + 3?"}]
    prompt2 = conversation.prompt_for(second, None)
    assert prompt2.ids[: len(prompt1.ids) + len(completion1)] == prompt1.ids + completion1
    assert prompt2.reused_tokens == len(prompt1.ids) + len(completion1)
    # the text is what the template says; only the token boundaries of history differ
    rendered = tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt2.ids) == rendered
    assert prompt2.ids != tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_canonical_ids_give_the_same_prompt_as_templating_everything(
    conversation, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 1?"}]
    _, _, reply = answer(conversation, tokenizer, first, "2")
    second = [*first, reply, {"role": "user", "content": "2 + 2?"}]
    rendered = tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert (
        conversation.prompt_for(second, None).ids
        == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    )


def test_an_answer_cut_by_max_tokens_gets_its_end_of_turn_from_the_template(
    conversation, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    first = [{"role": "user", "content": "Count"}]
    prompt1, completion1, reply = answer(conversation, tokenizer, first, "1 2 3", stop=False)
    second = [*first, reply, {"role": "user", "content": "go on"}]
    prompt2 = conversation.prompt_for(second, None)
    assert prompt2.ids[: len(prompt1.ids) + len(completion1)] == prompt1.ids + completion1
    rendered = tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(prompt2.ids) == rendered


def test_edited_history_forks_instead_of_mixing(conversation, tokenizer) -> None:  # type: ignore[no-untyped-def]
    first = [{"role": "user", "content": "What is 5 + 5?"}]
    answer(conversation, tokenizer, first, "10")
    edited = {"role": "assistant", "content": "ten"}  # the agent rewrote our answer
    second = [*first, edited, {"role": "user", "content": "Sure?"}]
    prompt = conversation.prompt_for(second, None)
    assert prompt.reused_tokens == 0 and conversation.forks == 1
    rendered = tokenizer.apply_chat_template(second, tokenize=False, add_generation_prompt=True)
    assert prompt.ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    # a truncated history (first message dropped) also starts a new branch
    assert conversation.prompt_for([{"role": "user", "content": "Sure?"}], None).reused_tokens == 0


def test_siblings_each_continue_their_own_branch(conversation, tokenizer) -> None:  # type: ignore[no-untyped-def]
    first = [{"role": "user", "content": "Pick a number"}]
    _, a_ids, a = answer(conversation, tokenizer, first, "7")
    _, b_ids, b = answer(conversation, tokenizer, first, "9")
    follow = {"role": "user", "content": "why?"}
    via_b = conversation.prompt_for([*first, b, follow], None)
    assert b_ids[0] in via_b.ids and via_b.reused_tokens > 0
    via_a = conversation.prompt_for([*first, a, follow], None)
    assert via_a.ids[: via_a.reused_tokens][-len(a_ids) :] == a_ids


def test_tool_calls_match_whatever_json_spacing_the_agent_sends_back(
    conversation, tokenizer
) -> None:  # type: ignore[no-untyped-def]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "add two ints",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    first = [{"role": "user", "content": "Add 2 and 3"}]
    prompt = conversation.prompt_for(first, tools)
    raw = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    completion = engine_output(tokenizer, raw)
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
        ],
    }
    conversation.record(first, tools, reply, prompt.ids, completion, tokenizer.decode(completion))
    sent_back = json.loads(json.dumps(reply))
    sent_back["tool_calls"][0]["function"]["arguments"] = '{"a":2,"b":3}'
    assert normalize_message(sent_back) == normalize_message(reply)
    second = [*first, sent_back, {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    prompt2 = conversation.prompt_for(second, tools)
    assert prompt2.ids[: len(prompt.ids) + len(completion)] == prompt.ids + completion
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(prompt2.ids)
    # other tools: another conversation root
    assert conversation.prompt_for(second, None).reused_tokens == 0
