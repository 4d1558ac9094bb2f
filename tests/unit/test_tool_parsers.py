"""Tool-call parsing and the per-choice text (stop strings, what may be streamed)."""

from __future__ import annotations

import json

import pytest

from sf_gateway.choice import Choice
from sf_gateway.tool_parsers import (
    TOOL_PARSERS,
    QwenToolParser,
    get_tool_parser,
    register_tool_parser,
)


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
        '<tool_call>["f"]</tool_call>',
        "<tool_call>",  # opened, nothing after it
    ],
)
def test_a_block_naming_no_function_stays_content_with_an_error(text: str) -> None:
    parsed = parse(text)
    assert parsed.tool_calls == [] and parsed.content == text
    [error] = parsed.errors
    assert error.kind == "no_name" and error.tool_call_id is None


@pytest.mark.parametrize(
    ("text", "kind", "arguments"),
    [
        # broken JSON: the arguments as the model wrote them
        ('<tool_call>{"name": "add", "arguments": {"a": 7, "b": }}</tool_call>', "invalid_json",
         '{"a": 7, "b": }}'),
        # the block's JSON broken after complete arguments: those arguments
        ('<tool_call>{"name": "add", "arguments": {"a": 7}</tool_call>', "invalid_json",
         '{"a": 7}'),
        ('<tool_call>{"name": "add", "argu</tool_call>', "invalid_json", ""),
        # JSON, but the arguments are no object
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "invalid_arguments", "[1]"),
        ('<tool_call>{"name": "f", "arguments": "not json"}</tool_call>', "invalid_arguments",
         "not json"),
    ],
)  # fmt: skip
def test_a_malformed_call_with_a_name_is_returned_as_written(
    text: str, kind: str, arguments: str
) -> None:
    """What OpenAI documents without strict mode: the call, its arguments as generated,
    left to the agent to check; and the error that says what is wrong."""
    parsed = parse("Let me see. " + text)
    [call] = parsed.tool_calls
    assert (call.arguments, parsed.content) == (arguments, "Let me see. ")
    [error] = parsed.errors
    assert error.kind == kind and error.tool_call_id == call.id
    assert error.body() == {"type": kind, "message": error.message, "tool_call_id": call.id}
    assert not parsed.unfinished


def test_an_unclosed_last_block_is_a_call_as_vllm_reads_it() -> None:
    parsed = parse('<tool_call>{"name": "f", "arguments": {"x": 1}}')
    [call] = parsed.tool_calls
    assert json.loads(call.arguments) == {"x": 1} and parsed.errors == ()
    assert parsed.unfinished and parsed.content is None
    cut = parse('<tool_call>{"name": "f", "arguments": {"x": 1')  # cut by max_tokens
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("f", '{"x": 1')]
    assert cut.unfinished and [e.kind for e in cut.errors] == ["invalid_json"]


def test_a_malformed_block_next_to_a_good_one() -> None:
    bad = "<tool_call>{oops}</tool_call>"
    parsed = parse(bad + '<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert [c.name for c in parsed.tool_calls] == ["f"] and parsed.content == bad
    assert [e.kind for e in parsed.errors] == ["no_name"] and not parsed.unfinished


def test_whitespace_only_content_is_none() -> None:
    assert parse(' \n<tool_call>{"name": "f"}</tool_call>\n').content is None


def test_registry_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="known"):
        get_tool_parser("nope")
    # registered into a copy of the registry that the test takes back: the configuration
    # reference lists what is registered (tests/unit/test_cli_and_service_table.py)
    monkeypatch.setattr(TOOL_PARSERS, "_plugins", dict(TOOL_PARSERS._plugins))

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
