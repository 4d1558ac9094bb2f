"""tool_choice 'required' and a named function, parsed on their own: the opening of a call
the gateway appends to the prompt (the tool parser's format) and the model's
continuation parse as one call, and a forced call the model did not finish is still a
call, its arguments as generated. Through a real gateway and engine:
tests/service/test_forced_tool_calls.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sf_gateway.choice import Choice
from sf_gateway.responses import ChatFormat
from sf_gateway.tool_parsers import QwenToolParser


@pytest.mark.parametrize(
    ("name", "generated", "expected"),
    [
        ("add", ' {"a": 2, "b": 3}}\n</tool_call>', ("add", {"a": 2, "b": 3})),
        (None, 'now", "arguments": {}}\n</tool_call>', ("now", {})),
    ],
)
def test_the_opening_and_the_model_s_continuation_parse_as_one_call(
    name: str | None, generated: str, expected: tuple[str, dict[str, Any]]
) -> None:
    parser = QwenToolParser()
    opening = parser.call_opening(name)
    assert opening.startswith(parser.start_marker)
    choice = Choice(0, lambda ids: opening + generated[: len(ids)], hold_from=parser.start_marker)
    choice.extend(list(range(len(generated))), [0.0] * len(generated), [0] * len(generated), [])
    assert choice.safe_text() == ""  # held from the opening on while streaming
    [call] = parser.parse(choice.text).tool_calls
    assert (call.name, json.loads(call.arguments)) == expected


@pytest.mark.parametrize(
    ("name", "generated", "expected"),
    [
        # cut inside the arguments: the arguments as generated, not valid JSON
        ("add", ' {"a": 2, "b"', ("add", '{"a": 2, "b"')),
        # the arguments complete, the block not closed: the arguments' own JSON
        ("add", ' {"a": 2, "b": 3}}', ("add", '{"a": 2, "b": 3}')),
        # required: the name the model wrote
        (None, 'now", "arguments": {', ("now", "{")),
        (None, 'now", "argu', ("now", "")),
        # required, the name itself unfinished: no call to give
        (None, "no", None),
    ],
)
def test_a_forced_call_the_model_did_not_finish_is_still_a_call(
    name: str | None, generated: str, expected: tuple[str, str] | None
) -> None:
    """OpenAI's promise for tool_choice 'required' or a named function: the answer is a
    tool call, its arguments as generated (the agent checks them). The sampling stays
    unconstrained: the recorded logprobs are the model's own. The parse that reads any
    malformed call reads these too; the error says what is wrong with it."""
    parser = QwenToolParser()
    text = parser.call_opening(name) + generated
    choice = Choice(0, lambda ids: text)
    choice.extend([1], [0.0], [0], [])
    choice.finish_reason = "length"
    view = chat_view(parser)
    message = view.message(choice)
    if expected is None:
        assert "tool_calls" not in message and message["content"] == text
        assert [e.kind for e in view.parsed(choice).errors] == ["no_name"]
        return
    [sent] = message["tool_calls"]
    assert (sent["function"]["name"], sent["function"]["arguments"]) == expected
    assert message["content"] is None
    # cut by the budget: "length", as OpenAI says; ended by the model: "tool_calls"
    assert view.finish_reason(choice) == "length"
    choice.finish_reason = "stop"
    assert chat_view(parser).finish_reason(choice) == "tool_calls"


def chat_view(parser: QwenToolParser) -> ChatFormat:
    return ChatFormat(model="policy", token_text=str, parser=parser)
