"""The ``openenv_tools`` agent's pure parts: an environment's MCP tools as OpenAI tools,
a call's arguments checked before they are sent, and a ``tools/call`` reply read as the
tool message, the reward and the end (the whole agent against TextArena's server is in
tests/mesh/test_third_party_envs.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from seamlessflow.agents.openenv_tools_agent import call_arguments, openai_tools, tool_outcome
from seamlessflow.envs.openenv_client import EnvFailed

LISTING = {
    "jsonrpc": "2.0",
    "id": 1,
    "result": {
        "tools": [
            {
                "name": "new_game",
                "description": "Start a game.",
                "input_schema": {"type": "object"},
            },
            {
                "name": "move",
                "description": "Make your move.",
                "input_schema": {"type": "object", "properties": {"action": {"type": "string"}}},
            },
        ]
    },
}


def test_the_environment_s_tools_are_offered_as_functions_less_the_hidden_ones() -> None:
    tools = openai_tools(LISTING, hidden=("new_game",))
    assert tools == [
        {
            "type": "function",
            "function": {
                "name": "move",
                "description": "Make your move.",
                "parameters": {"type": "object", "properties": {"action": {"type": "string"}}},
            },
        }
    ]
    assert [t["function"]["name"] for t in openai_tools(LISTING, hidden=())] == ["new_game", "move"]
    with pytest.raises(EnvFailed, match="no tool the agent may call"):
        openai_tools(LISTING, hidden=("new_game", "move"))
    with pytest.raises(EnvFailed, match="answered no tools"):
        openai_tools({"jsonrpc": "2.0", "id": 1, "error": {"message": "no"}}, hidden=())


def call(name: str, arguments: str) -> SimpleNamespace:
    return SimpleNamespace(function=SimpleNamespace(name=name, arguments=arguments))


@pytest.mark.parametrize(
    ("name", "arguments", "sent", "why"),
    [
        ("move", '{"action": "[10]"}', {"action": "[10]"}, ""),
        ("move", "", {}, ""),
        ("move", '{"action": "[10]"', None, "are not JSON"),
        ("move", '["[10]"]', None, "must be a JSON object"),
        ("new_game", '{"seed": 3}', None, "there is no tool 'new_game'"),
    ],
)
def test_a_call_is_sent_only_when_the_environment_can_run_it(
    name: str, arguments: str, sent: dict[str, str] | None, why: str
) -> None:
    got, refusal = call_arguments(call(name, arguments), offered={"move"})
    assert got == sent
    assert (why in refusal and refusal.startswith("error: ")) if why else refusal == ""


def reply(**result: object) -> dict[str, object]:
    return {"jsonrpc": "2.0", "id": 2, "result": result}


def test_the_outcome_is_the_tool_result_s_reward_and_done() -> None:
    # TextArena's move: the outcome in the tool's structured result
    moved = reply(structured_content={"prompt": "higher", "reward": 0.0, "done": False})
    assert tool_outcome(moved) == ("higher", 0.0, False)
    won = reply(structured_content={"prompt": "Congratulations", "reward": 1.0, "done": True})
    assert tool_outcome(won) == ("Congratulations", 1.0, True)
    # a plain return value (FastMCP wraps it) and a text-only result: no reward, no end
    plain = reply(structured_content={"result": 7}, content=[{"type": "text", "text": "7"}])
    assert tool_outcome(plain) == ("7", 0.0, False)
    text = reply(content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert tool_outcome(text) == ("a\nb", 0.0, False)
    # errors, the tool's or the server's, are the model's to read, not a failure
    refused = reply(is_error=True, content=[{"type": "text", "text": "the game is over"}])
    assert tool_outcome(refused) == ("error: the game is over", 0.0, False)
    unknown = {"jsonrpc": "2.0", "id": 3, "error": {"code": -32602, "message": "no tool x"}}
    assert tool_outcome(unknown) == ("error: no tool x", 0.0, False)
