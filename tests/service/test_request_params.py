"""Every request parameter of chat completions and completions is honoured or refused,
through the real gateway with the official SDK as the client: a refused or unknown
parameter is a 400 naming the field, and nothing is stored; null, neutral values and
parameters without effect are accepted. The tables themselves are checked against the
``openai`` package's request types in tests/unit/test_request_param_tables.py; the
values sent are tests/support/request_params.py's.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from seamlessflow.bus import Bus
from seamlessflow.protocol import TurnRecorded
from sf_gateway.openai_api import CHAT_PARAMS, COMPLETION_PARAMS
from tests.support import GATEWAY_MAX_CONTEXT, trajectory_events
from tests.support.request_params import NEUTRAL_VALUES, NO_EFFECT_VALUES, REFUSED_VALUES, refused

MAX_CONTEXT = GATEWAY_MAX_CONTEXT  # the context of the gateway_url fixture


async def open_client(http: httpx.AsyncClient) -> tuple[dict[str, Any], AsyncOpenAI]:
    response = await http.post("/sessions", json={})
    assert response.status_code == 201, response.text
    session = response.json()
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    return session, client


MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


async def chat(client: AsyncOpenAI, **body: Any) -> Any:
    return await client.chat.completions.create(
        model="policy",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=3,
        extra_body=body,
    )


async def complete(client: AsyncOpenAI, **body: Any) -> Any:
    return await client.completions.create(
        model="policy", prompt="2 + 2 =", max_tokens=3, extra_body=body
    )


async def expect_400(call: Any, param: str) -> str:
    with pytest.raises(BadRequestError) as refused:
        await call
    error = refused.value.body
    assert isinstance(error, dict), error
    assert error["param"] == param and param in error["message"], error
    assert error["type"] == "invalid_request_error"
    return str(error["message"])


async def test_refused_and_unknown_parameters_are_400s_naming_them_and_store_nothing(
    gateway_url: str, bus: Bus
) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session, client = await open_client(http)
        async with client:
            before = await trajectory_events(bus)
            for name in refused(CHAT_PARAMS):
                await expect_400(chat(client, **{name: REFUSED_VALUES[name]}), name)
            for name in refused(COMPLETION_PARAMS):
                await expect_400(complete(client, **{name: REFUSED_VALUES[name]}), name)
            message = await expect_400(chat(client, frobnicate=1), "frobnicate")
            assert "unknown parameter" in message
            await expect_400(complete(client, min_p=0.3, frobnicate=1), "min_p")  # the first one
            # JSON output needs an engine that constrains (vLLM): the transformers engine
            # (this mesh's) refuses it, named; malformed formats are refused by the gateway
            for form in (
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
            ):
                message = await expect_400(chat(client, response_format=form), "response_format")
                assert "transformers engine" in message and "SF_ENGINE_BACKEND=vllm" in message
            for form in (
                {"type": "yaml"},
                {"type": "json_schema"},
                {"type": "json_schema", "json_schema": {"schema": 3}},
            ):
                await expect_400(chat(client, response_format=form), "response_format")
            assert await trajectory_events(bus) == before  # no turn, no session change

            # Null, the neutral values and the parameters without effect are accepted: the
            # session still works and records exactly one turn per request.
            nulls = {name: None for name in refused(CHAT_PARAMS)}
            chat_neutral = {k: v for k, v in NEUTRAL_VALUES.items() if k in CHAT_PARAMS}
            chat_inert = {k: v for k, v in NO_EFFECT_VALUES.items() if k in CHAT_PARAMS}
            reply = await chat(client, **nulls, response_format=None)
            reply2 = await chat(
                client, **chat_neutral, **chat_inert, response_format={"type": "text"}
            )
            completion_neutral = {k: v for k, v in NEUTRAL_VALUES.items() if k in COMPLETION_PARAMS}
            reply3 = await complete(client, **completion_neutral, user="agent-7")
    turns = [e for e in await trajectory_events(bus) if isinstance(e, TurnRecorded)]
    assert [t.session_id for t in turns] == [session["session_id"]] * 3
    assert [t.turn_index for t in turns] == [0, 1, 2]  # the refusals counted no turn
    assert [t.completion_text for t in turns] == [
        reply.choices[0].message.content,
        reply2.choices[0].message.content,
        reply3.choices[0].text,
    ]


async def test_a_budget_beyond_the_context_is_a_400_naming_it(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session, client = await open_client(http)
        async with client:
            before = await trajectory_events(bus)
            for name in ("max_tokens", "max_completion_tokens"):
                for huge in (MAX_CONTEXT, 1_000_000_000):
                    with pytest.raises(BadRequestError) as refused:
                        await client.chat.completions.create(
                            model="policy",
                            messages=MESSAGES,  # type: ignore[arg-type]
                            **{name: huge},  # type: ignore[arg-type]
                        )
                    assert isinstance(refused.value.body, dict)
                    assert refused.value.body["param"] == name
                    assert refused.value.body["code"] == "context_length_exceeded"
                for bad in (0, -1):
                    await expect_400(chat(client, **{name: bad}), name)
            for budget in (MAX_CONTEXT, 0):
                with pytest.raises(BadRequestError) as refused:
                    await client.completions.create(
                        model="policy", prompt="2 + 2 =", max_tokens=budget
                    )
                assert isinstance(refused.value.body, dict)
                assert refused.value.body["param"] == "max_tokens"
            assert await trajectory_events(bus) == before

            # the largest budget that fits is taken as asked; without one the default is
            # clipped to the room the prompt leaves
            prompt_tokens = (await chat(client)).usage.prompt_tokens
            room = MAX_CONTEXT - prompt_tokens
            await client.chat.completions.create(
                model="policy",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_completion_tokens=room,
                temperature=0,
            )
            await client.chat.completions.create(model="policy", messages=MESSAGES)  # type: ignore[arg-type]
    turns = [e for e in await trajectory_events(bus) if isinstance(e, TurnRecorded)]
    assert len(turns) == 3 and all(len(t.completion_ids) <= room for t in turns)
    assert all(t.session_id == session["session_id"] for t in turns)


async def test_top_k_is_applied_and_recorded_with_the_turn(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        _session, client = await open_client(http)
        async with client:
            for bad in (-2, 1.5, "x"):
                await expect_400(chat(client, top_k=bad), "top_k")
            await chat(client, top_k=3, temperature=0.8, seed=1)
            await complete(client, top_k=-1)
            await chat(client)
    turns = [e for e in await trajectory_events(bus) if isinstance(e, TurnRecorded)]
    assert [(t.top_k, t.temperature) for t in turns] == [(3, 0.8), (0, 1.0), (0, 1.0)]
