"""The session prefix tree with the real chat template and tokenizer of the base model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from sf_gateway.conversation import Conversation, normalize_message


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


def engine_output(
    tokenizer, text: str, *, stop: bool = True, char_by_char: bool = False
) -> list[int]:  # type: ignore[no-untyped-def]
    """Ids as an engine might produce them: not necessarily the canonical tokenization."""
    if char_by_char:
        ids = [tokenizer.convert_tokens_to_ids(t) for c in text for t in tokenizer.tokenize(c)]
    else:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [*ids, tokenizer.convert_tokens_to_ids("<|im_end|>")] if stop else list(ids)


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


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from seamlessflow.assets.families import build_family_model

    return AutoTokenizer.from_pretrained(
        str(build_family_model("qwen3", tmp_path_factory.mktemp("qwen3")))
    )


def test_a_reply_the_template_rewrites_is_continued_from_its_prompt(qwen3) -> None:  # type: ignore[no-untyped-def]
    """Qwen3 drops a think block once a later user message follows: the next prompt is
    the template's rendering (the node's prompt ids + the rest), not the node's ids. In
    a tool loop (no new user message) the think block stays: exact ids continue."""
    from sf_gateway.reasoning import Qwen3ReasoningParser

    def render(messages: list[dict[str, Any]], tools: Any, generation: bool) -> str:
        return str(qwen3.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=generation))  # fmt: skip

    def encode(text: str) -> list[int]:
        return list(qwen3(text, add_special_tokens=False)["input_ids"])

    parser = Qwen3ReasoningParser()
    conversation = Conversation(render=render, encode=encode, end_of_turn="<|im_end|>",
                                reasoning=lambda text: parser.split(text)[0])  # fmt: skip
    first = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt1 = conversation.prompt_for(first, None)
    completion = engine_output(qwen3, "<think>\nTwo and two.\n</think>\n\n4")
    reply = {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    raw = qwen3.decode(completion)
    conversation.record(first, None, reply, prompt1.ids, completion, raw)

    second = [*first, {"role": "assistant", "content": "4"}, {"role": "user", "content": "Sure?"}]
    prompt2 = conversation.prompt_for(second, None)
    assert prompt2.rewritten and prompt2.parent == Conversation.node_key(first, None, reply)
    assert prompt2.ids[: len(prompt1.ids)] == prompt1.ids
    assert qwen3.decode(prompt2.ids) == render(second, None, True)
    assert "<think>" not in qwen3.decode(prompt2.ids)
    # resending the reasoning changes nothing: the template drops it all the same
    resent = [*first, reply, second[-1]]
    assert conversation.prompt_for(resent, None).ids == prompt2.ids

    # a tool result follows (no user message): the think block stays, ids continue
    call = {"type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    tool_reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    text = (
        '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n'
        "</tool_call>"
    )
    completion = engine_output(qwen3, text)
    conversation.record(first, None, tool_reply, prompt1.ids, completion, qwen3.decode(completion))
    loop = [*first, tool_reply, {"role": "tool", "tool_call_id": "c", "content": "4"}]
    prompt3 = conversation.prompt_for(loop, None)
    assert not prompt3.rewritten and prompt3.reused_tokens == len(prompt1.ids) + len(completion)
    assert prompt3.ids[: prompt3.reused_tokens] == [*prompt1.ids, *completion]
