"""Tool-call parsing and the per-choice text (stop strings, what may be streamed)."""

from __future__ import annotations

import json

import pytest

from sf_gateway.choice import Choice
from sf_gateway.tool_parsers import QwenToolParser, get_tool_parser, register_tool_parser


def parse(text: str):  # type: ignore[no-untyped-def]
    return get_tool_parser("qwen").parse(text)


def test_one_call_and_no_content() -> None:
    parsed = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert parsed.content is None
    [call] = parsed.tool_calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 1, "b": 2}
    assert call.id.startswith("call_")


def test_several_calls_keep_the_text_around_them() -> None:
    text = (
        "Let me look.\n"
        '<tool_call>{"name": "f", "arguments": {"x": "é"}}</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": "{\\"y\\": [1]}"}</tool_call> done'
    )
    parsed = parse(text)
    assert [c.name for c in parsed.tool_calls] == ["f", "g"]
    assert json.loads(parsed.tool_calls[0].arguments) == {"x": "é"}
    assert json.loads(parsed.tool_calls[1].arguments) == {"y": [1]}  # string args decoded
    assert parsed.content == "Let me look.\n\n done"
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_missing_arguments_are_an_empty_object() -> None:
    [call] = parse('<tool_call>{"name": "now"}</tool_call>').tool_calls
    assert call.arguments == "{}"


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "f", "arguments": {}}',  # cut by max_tokens: unclosed
        "no calls at all",
    ],
)
def test_malformed_blocks_stay_content(text: str) -> None:
    parsed = parse(text)
    assert parsed.tool_calls == [] and parsed.content == text


def test_a_malformed_block_next_to_a_good_one() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    parsed = parse(bad + '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content == bad


def test_whitespace_only_content_is_none() -> None:
    assert parse(' \n<tool_call>{"name": "f"}</tool_call>\n').content is None


def test_registry_by_name() -> None:
    with pytest.raises(ValueError, match="known"):
        get_tool_parser("nope")

    @register_tool_parser("test-upper")
    class Upper(QwenToolParser):
        start_marker = "<TOOL>"

    assert isinstance(get_tool_parser("test-upper"), Upper)


# ------------------------------------------------------------------ Choice


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def decode(ids: list[int]) -> str:
    return "".join(chr(i) for i in ids)


def feed(choice: Choice, text: str) -> bool:
    ids = chars(text)
    return choice.extend(ids, [0.0] * len(ids), [0] * len(ids), [])


def test_stop_string_cuts_text_and_keeps_the_completing_token() -> None:
    choice = Choice(0, decode, stop=("END", "xyz"))
    assert not feed(choice, "abcE")
    assert choice.safe_text() == "abc"  # "E" may become "END"
    assert feed(choice, "NDmore")
    assert choice.stopped and choice.text == "abc"
    assert decode(choice.token_ids) == "abcEND"  # up to the token that completed it
    assert not feed(choice, "ignored") and decode(choice.token_ids) == "abcEND"


def test_stop_string_inside_one_multi_char_token() -> None:
    choice = Choice(0, lambda ids: "".join({1: "ab", 2: "cSTOPd", 3: "e"}[i] for i in ids),
                    stop=("STOP",))  # fmt: skip
    assert choice.extend([1, 2, 3], [0.0] * 3, [0] * 3, [])
    assert choice.token_ids == [1, 2] and choice.text == "abc"


def test_incomplete_characters_and_tool_calls_are_held_back() -> None:
    choice = Choice(0, decode, hold_from="<tool_call>")
    feed(choice, "  ")
    assert choice.safe_text() == ""  # whitespace alone may be no content at all
    feed(choice, "Hi <tool")
    assert choice.safe_text() == "  Hi "
    feed(choice, '_call>{"name"')
    assert choice.safe_text() == "  Hi "
    choice = Choice(0, decode)
    feed(choice, "ok\ufffd")
    assert choice.safe_text() == "ok"
