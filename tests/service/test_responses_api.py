"""`/v1/responses` over real HTTP, NATS and engine worker: the Responses API as the
`openai` client and the OpenAI Agents SDK use it, recorded like chat turns. The engine
is `tool_script.ToolScriptEngine` (it calls tools when asked, so tool loops run), on a
tied-embedding model's tokenizer and template."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from transformers import AutoTokenizer

from seamlessflow.bus import Bus
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from tests.support import InProcessMesh, session_auth, session_turns
from tests.support.tool_script import tool_script_gateway

pytestmark = pytest.mark.usefixtures("openai_shapes")

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
        "strict": True,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {k: v for k, v in TOOLS[0].items() if k not in ("type", "strict")},
    }
]


@pytest.fixture
async def gateway_url(
    nats_url: str, run_id: str, qwen2_tied_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[str]:
    async with tool_script_gateway(nats_url, run_id, qwen2_tied_model_dir, monkeypatch) as url:
        yield url


async def new_session(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url) as http:
        response = await http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


def sse_events(raw: str) -> list[dict[str, Any]]:
    """The JSON of every ``data:`` line, each also checked against the SDK's union."""
    events = []
    for line in raw.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[len("data: ") :])
            EVENTS.validate_python(event)
            events.append(event)
    return events


async def test_a_string_input_is_a_chat_turn_with_an_sdk_valid_response(
    gateway_url: str, bus: Bus, qwen2_tied_model_dir: Path
) -> None:
    session = await new_session(gateway_url)
    body = {"model": "policy", "input": "Hello there", "instructions": "Be brief.",
            "max_output_tokens": 20, "metadata": {"k": "v"}, "store": False}  # fmt: skip
    async with httpx.AsyncClient() as http:
        raw = await http.post(
            f"{session['base_url']}/responses", json=body, headers=session_auth(session)
        )
    assert raw.status_code == 200, raw.text
    response = Response.model_validate(raw.json())
    assert response.status == "completed" and response.metadata == {"k": "v"}
    assert response.output_text == "No tool needed."
    [turn] = await session_turns(bus, session["session_id"])
    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tied_model_dir))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
    ]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert turn.prompt_ids == tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert turn.completion_text == response.output_text
    assert response.usage is not None
    assert response.usage.input_tokens == len(turn.prompt_ids)
    assert response.usage.output_tokens == len(turn.completion_ids)


async def test_tool_calls_round_trip_as_items_and_continue_the_branch(
    gateway_url: str, bus: Bus, qwen2_tied_model_dir: Path
) -> None:
    session = await new_session(gateway_url)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    question = [{"role": "user", "content": "What is 7 + 12?"}]
    async with client:
        first = await client.responses.create(model="policy", input=question, tools=TOOLS)  # type: ignore[arg-type]
        [call] = first.output
        assert call.type == "function_call" and call.name == "add"
        assert json.loads(call.arguments) == {"a": 7, "b": 12}
        history = [
            *question,
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "19"},
        ]
        second = await client.responses.create(model="policy", input=history, tools=TOOLS)  # type: ignore[arg-type]
    assert second.output_text == "The result is 19."
    turns = await session_turns(bus, session["session_id"])
    assert len(turns) == 2
    # the second prompt is the first turn's exact ids, then only the new messages
    assert turns[1].prompt_ids[: len(turns[0].prompt_ids) + len(turns[0].completion_ids)] == [
        *turns[0].prompt_ids,
        *turns[0].completion_ids,
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(qwen2_tied_model_dir))
    chat_history = [
        *question,
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 7, "b": 12}}}]},
        {"role": "tool", "content": "19"},
    ]  # fmt: skip
    templated = tokenizer.apply_chat_template(
        chat_history, tools=CHAT_TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert turns[1].prompt_ids == tokenizer(templated, add_special_tokens=False)["input_ids"]
    async with httpx.AsyncClient() as http:
        exported = (
            await http.get(
                f"{gateway_url}/sessions/{session['session_id']}/export",
                headers=session_auth(session),
            )
        ).json()
    [sample] = [s for s in exported["samples"] if s["final"]]
    assert sample["token_ids"] == [*turns[1].prompt_ids, *turns[1].completion_ids]
    assert sample["turn_indexes"] == [0, 1]


async def test_streamed_events_are_sdk_events_and_match_the_record(
    gateway_url: str, bus: Bus
) -> None:
    session = await new_session(gateway_url)
    async with httpx.AsyncClient(headers=session_auth(session)) as http:
        text = await http.post(
            f"{session['base_url']}/responses",
            json={"model": "policy", "input": "Say something", "stream": True},
        )
        call = await http.post(
            f"{session['base_url']}/responses",
            json={"model": "policy", "input": "What is 2 + 40?", "tools": TOOLS, "stream": True},
        )
    events = sse_events(text.text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = Response.model_validate(events[-1]["response"])
    turns = await session_turns(bus, session["session_id"])
    assert streamed == final.output_text == turns[0].completion_text == "No tool needed."

    events = sse_events(call.text)
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds  # the call's text is held, not streamed
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [item] = Response.model_validate(events[-1]["response"]).output
    assert item.type == "function_call" and json.loads(item.arguments) == {"a": 2, "b": 40}
    assert events[3]["delta"] == item.arguments
    assert len(await session_turns(bus, session["session_id"])) == 2


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input[0].output"),
        ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]},
         "input[0].name"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]},
         "tools.0.parameters"),
        ({"seed": 3}, "seed"),
    ],
)  # fmt: skip
async def test_unsupported_fields_are_400s_naming_them_and_store_nothing(
    gateway_url: str, bus: Bus, change: dict[str, Any], param: str
) -> None:
    session = await new_session(gateway_url)
    body = {"model": "policy", "input": "hi", **change}
    async with httpx.AsyncClient(headers=session_auth(session)) as http:
        answer = await http.post(f"{session['base_url']}/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert await session_turns(bus, session["session_id"]) == []


async def test_a_text_answer_sent_back_as_its_message_item_continues_the_branch(
    gateway_url: str, bus: Bus
) -> None:
    session = await new_session(gateway_url)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    question = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]  # fmt: skip
    async with client:
        first = await client.responses.create(model="policy", input=question)  # type: ignore[arg-type]
        [message] = first.output
        assert message.type == "message" and message.content[0].type == "output_text"
        history = [
            *question,
            message.model_dump(exclude_none=True),
            {"role": "user", "content": "And 1 + 2?"},
        ]
        await client.responses.create(model="policy", input=history)  # type: ignore[arg-type]
    first_turn, second_turn = await session_turns(bus, session["session_id"])
    async with httpx.AsyncClient(headers=session_auth(session)) as http:
        exported = await http.get(f"{gateway_url}/sessions/{session['session_id']}/export")
    # one branch through both turns: the second prompt reused the first turn's ids
    [sample] = exported.json()["samples"]
    assert sample["turn_indexes"] == [0, 1]
    assert sample["token_ids"] == [*second_turn.prompt_ids, *second_turn.completion_ids]
    assert sample["token_ids"][: len(first_turn.prompt_ids)] == first_turn.prompt_ids


async def test_an_engine_failure_after_the_stream_started_is_an_error_event(
    mesh: InProcessMesh, bus: Bus
) -> None:
    """No engine serves: the 503 comes once the events have started, as an ``error``
    event the SDK's union accepts, and nothing is recorded."""
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, engine_wait_s=0.2)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    session = await new_session(f"http://127.0.0.1:{gateway.bound_port}")
    async with httpx.AsyncClient(headers=session_auth(session)) as http:
        answer = await http.post(
            f"{session['base_url']}/responses",
            json={"model": "policy", "input": "hi", "stream": True},
        )
    events = sse_events(answer.text)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error"]
    assert events[-1]["code"] == "engine_unavailable"
    assert await session_turns(bus, session["session_id"]) == []
