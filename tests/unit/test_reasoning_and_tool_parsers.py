"""Each family's tool-call and reasoning format, parsed on its own: Llama 3's JSON calls,
Qwen3's think block (also when the prompt opens it), the format ``auto`` picks from a
family's template, and streamed prefixes that stay prefixes of the final split for every
tool parser. The same formats through a real gateway and data plane are
tests/service/test_reasoning_and_tools.py."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sf_gateway.reasoning import Qwen3ReasoningParser, reasoning_parser_for
from sf_gateway.tool_parsers import Llama3JsonToolParser, QwenToolParser, tool_parser_for


def test_llama3_json_calls() -> None:
    parser = Llama3JsonToolParser()
    [call] = parser.parse('{"name": "add", "parameters": {"a": 1, "b": 2}}').tool_calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    parsed = parser.parse('<|python_tag|>{"name": "f", "arguments": {}}; {"name": "g", '
                          '"parameters": {"x": [1]}}')  # fmt: skip
    assert [c.name for c in parsed.tool_calls] == ["f", "g"] and parsed.content is None
    for text in ['{"nam": "f"}', "{oops", "Hi {"]:
        assert parser.parse(text) == type(parsed)(text, [])
    # meant as a call and not one: content as a whole, and the error says so
    for text in ['{"name": "f", "parameters": {}} and more', '<|python_tag|>{"name": "f", "p']:
        broken = parser.parse(text)
        assert (broken.content, broken.tool_calls) == (text, [])
        assert [e.kind for e in broken.errors] == ["invalid_json"]


def test_reasoning_split() -> None:
    parser = Qwen3ReasoningParser()
    assert parser.split("<think>\nhmm\n</think>\n\n4") == ("hmm", "4")
    assert parser.split("4") == (None, "4")
    assert parser.split("<think>\nstill thinking") == ("still thinking", "")  # cut


def test_auto_picks_the_family_format() -> None:
    from seamlessflow.assets.families import SPECS

    assert isinstance(tool_parser_for("auto", SPECS["qwen3"].chat_template), QwenToolParser)
    llama = SPECS["llama3-tied"].chat_template
    assert isinstance(tool_parser_for("auto", llama), Llama3JsonToolParser)
    assert tool_parser_for("none", llama) is None
    assert isinstance(reasoning_parser_for("auto", SPECS["qwen3"].chat_template),
                      Qwen3ReasoningParser)  # fmt: skip
    assert reasoning_parser_for("auto", SPECS["qwen2"].chat_template) is None
    assert reasoning_parser_for("auto", llama) is None
    with pytest.raises(ValueError, match="known"):
        reasoning_parser_for("deepthought", llama)


def test_a_prompt_that_opens_the_think_block() -> None:
    """Templates that end the generation prompt with ``<think>`` (Qwen3-2507 thinking,
    DeepSeek-R1 distills): the answer starts inside the block."""
    from sf_gateway.choice import Choice
    from sf_gateway.reasoning import reasoning_of
    from sf_gateway.responses import ChatFormat

    parser = Qwen3ReasoningParser()
    view = ChatFormat(model="m", token_text=str, reasoning=parser, reasoning_opened=True)
    choice = Choice(0, lambda ids: "".join(chr(i) for i in ids))
    streamed = ""
    for ch in "\nHmm.\n</think>\n\n42":
        choice.extend([ord(ch)], [0.0], [0], [])
        chunk = view.progress(choice)
        if chunk is not None:
            streamed += chunk["choices"][0]["delta"].get("reasoning_content", "")
    choice.finish_reason = "stop"
    assert view.message(choice)["reasoning_content"] == streamed == "Hmm."
    assert view.message(choice)["content"] == "42"
    # the stored completion (special tokens kept) has its reasoning found the same way
    assert reasoning_of(parser, "\nHmm.\n</think>\n\n42<|im_end|>") == "Hmm."
    assert reasoning_of(parser, "<think>\nHmm.\n</think>\n\n42<|im_end|>") == "Hmm."
    assert reasoning_of(parser, "42<|im_end|>") is None


ANSWERS = [
    "<think>\nLet me add.\n</think>\n\n7 + 12 = 19",
    '<think>\nA tool.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n'
    "</tool_call>",
    'Sure. <tool_call>{"name": "add", "arguments": {}}</tool_call> <tool_call>{bad}',
    "<think>\ncut off </thi",
    "  <thin",
    "no think </think> here",
    '{"name": "add", "parameters": {"a": 1}}',
    "Plain { text",
]


@pytest.mark.parametrize("opened", [False, True], ids=["plain", "opened"])
@pytest.mark.parametrize("answer", ANSWERS)
def test_streamed_prefixes_are_prefixes_of_the_final_split(answer: str, opened: bool) -> None:
    """Whatever is streamed at any point is a prefix of the final reasoning and content,
    and a whole stream concatenates to the final message, for every tool parser."""
    from sf_gateway.choice import Choice
    from sf_gateway.responses import ChatFormat

    def chars(ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    for parser in (QwenToolParser(), Llama3JsonToolParser(), None):

        def view(parser: Any = parser) -> ChatFormat:
            return ChatFormat(
                model="m",
                token_text=str,
                parser=parser,
                reasoning=Qwen3ReasoningParser(),
                reasoning_opened=opened,
            )

        growing, choice = view(), Choice(0, chars)
        for ch in answer:
            choice.extend([ord(ch)], [0.0], [0], [])
            reasoning, content = growing.streamable(choice)
            final = view().parsed(choice)
            assert (final.reasoning or "").startswith(reasoning), (choice.text, reasoning)
            assert (final.content or "").startswith(content), (choice.text, content)

        stream, choice = view(), Choice(0, chars)
        sent_reasoning = sent_content = ""
        cuts = sorted(random.Random(answer).sample(range(len(answer)), min(3, len(answer))))
        for start, end in zip([0, *cuts], [*cuts, len(answer)], strict=True):
            n = end - start
            choice.extend([ord(c) for c in answer[start:end]], [0.0] * n, [0] * n, [])
            chunk = stream.progress(choice)
            if chunk is not None:
                delta = chunk["choices"][0]["delta"]
                sent_reasoning += delta.get("reasoning_content", "")
                sent_content += delta.get("content", "")
        choice.finish_reason = "stop"
        for chunk in stream.closing(choice):
            delta = chunk["choices"][0]["delta"]
            sent_reasoning += delta.get("reasoning_content", "")
            sent_content += delta.get("content") or ""
        message = stream.message(choice)
        assert sent_reasoning == (message["reasoning_content"] or "")
        assert sent_content == (message["content"] or "")
