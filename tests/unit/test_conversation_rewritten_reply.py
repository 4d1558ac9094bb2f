"""The session prefix tree with a template that rewrites a reply (Qwen3's drops a think
block once a later user message follows): the next prompt is the template's rendering
from the reply's prompt, and in a tool loop (no new user message) the exact ids go on.
Built from a tiny Qwen3 family model's tokenizer; the tree with the base model's
template is tests/service/test_conversation.py."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from sf_gateway.conversation import Conversation
from tests.support.token_texts import engine_output


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
