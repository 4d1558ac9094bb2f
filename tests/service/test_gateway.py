"""The gateway over real HTTP, with a real engine worker, scheduler and weight-sync on a
real nats-server; agents are the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
import msgspec
import pytest
from openai import AsyncOpenAI, NotFoundError, OpenAI
from pydantic import SecretStr
from transformers import AutoTokenizer

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    RewardReported,
    SessionFinished,
    SessionOpened,
    TurnRecorded,
)
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from tests.support import free_port, session_auth, trajectory_events

# every answer the gateway gives in these tests is checked against the openai types
pytestmark = pytest.mark.usefixtures("openai_shapes")


async def new_session(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_an_unmodified_openai_client_only_sets_base_url(
    gateway_url: str, bus: Bus, base_model_dir
) -> None:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http, task_id="t1", reference="4", reward_fn="integer_match")
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            messages = [{"role": "user", "content": "What is 2 + 2?"}]
            reply = await client.chat.completions.create(
                model="policy",
                messages=messages,
                max_tokens=6,
                logprobs=True,
                seed=1,  # type: ignore[arg-type]
            )
            models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        finish = await http.post(
            f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
        )
        assert finish.status_code == 200

    events = await trajectory_events(bus)
    turns = [e for e in events if isinstance(e, TurnRecorded)]
    assert isinstance(events[0], SessionOpened) and len(turns) == 1
    turn = turns[0]
    tokenizer = AutoTokenizer.from_pretrained(str(base_model_dir))
    expected_prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    # what the engine consumed is exactly the templated prompt; what the agent read is
    # exactly the decoded completion, with the same logprobs
    assert turn.prompt_ids == expected_prompt
    assert 1 <= len(turn.completion_ids) <= 6
    choice = reply.choices[0]
    assert choice.message.content == turn.completion_text
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(turn.logprobs)  # type: ignore[union-attr]
    assert turn.versions == [0] * len(turn.completion_ids)
    assert reply.usage is not None and reply.usage.prompt_tokens == len(expected_prompt)


async def test_completions_accept_token_id_prompts(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            reply = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=3)
    turn = next(e for e in await trajectory_events(bus) if isinstance(e, TurnRecorded))
    assert turn.prompt_ids == [5, 6, 7]
    assert reply.choices[0].text == turn.completion_text


BAD_CHAT_REQUESTS = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"", 400, None),
    (b'{"model": "policy"}', 400, "messages"),
    (b'{"model": "policy", "messages": []}', 400, "messages"),
    (b'{"model": "policy", "messages": [{"role": "wizard", "content": "x"}]}', 400, None),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
        400,
        "max_tokens",
    ),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": 9}',
        400,
        "temperature",
    ),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 17}', 400, "n"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "' + b"9 " * 400 + b'"}]}',
        400,
        None,
    ),
]


def _chat(**fields: Any) -> bytes:
    return json.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "x"}], **fields}
    ).encode()


def _tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "add", "parameters": {}, **function}}


BAD_CHAT_REQUESTS += [
    (_chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (_chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (_chat(top_logprobs=2), 400, "top_logprobs"),
    (_chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (_chat(stop=[""]), 400, "stop"),
    (_chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (_chat(seed="x"), 400, "seed"),
    (_chat(tools=[{"type": "retrieval"}]), 400, "tools.0"),
    (_chat(tools=[{"type": "function"}]), 400, "tools.0.function"),
    (_chat(tools=[_tool(name="has space")]), 400, "tools.0.function.name"),
    (_chat(tools=[_tool(parameters={"type": "string"})]), 400, "tools.0.function.parameters"),
    (_chat(tools=[_tool(parameters=[1])]), 400, "tools.0.function.parameters"),
    (_chat(tools=[_tool()], tool_choice="sometimes"), 400, "tool_choice"),
    (_chat(tool_choice="required"), 400, "tool_choice"),
    (_chat(tools=[_tool()], tool_choice="required", stop=["\n"]), 400, "stop"),
    (
        _chat(tools=[_tool()], tool_choice="required", response_format={"type": "json_object"}),
        400,
        "response_format",
    ),
    (
        _chat(tools=[_tool()], tool_choice={"type": "function", "function": {"name": "mul"}}),
        400,
        "tool_choice",
    ),
    (
        _chat(tools=[_tool()], tool_choice={"type": "custom", "custom": {"name": "add"}}),
        400,
        "tool_choice",
    ),
    (_chat(tool_choice="auto"), 400, "tool_choice"),
    (
        _chat(messages=[{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]),
        400,
        "messages.1",
    ),
    (
        _chat(
            messages=[
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        ),
        400,
        "messages.0",
    ),
    (_chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages.0"),
    (_chat(stream=True, model="nope"), 404, "model"),
    (_chat(stream=True, n=99), 400, "n"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT_REQUESTS)
async def test_bad_chat_requests_get_openai_errors_and_store_nothing(
    gateway_url: str, bus: Bus, body: bytes, status: int, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
        before = await trajectory_events(bus)
        response = await http.post(
            f"/s/{session['session_id']}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", **session_auth(session)},
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"
    if param is not None:
        assert param in (error["param"] or "")
    assert await trajectory_events(bus) == before


async def test_session_errors_and_bad_rewards(gateway_url: str, bus: Bus) -> None:
    chat = {"model": "policy", "messages": [{"role": "user", "content": "1 + 1?"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        unknown = await http.post("/s/sdoesnotexist/v1/chat/completions", json=chat)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
        session = await new_session(http)
        sid = session["session_id"]
        before = await trajectory_events(bus)
        for bad in ({"reward": "high"}, {}, {"reward": 1, "extra": 2}):
            response = await http.post(
                f"/sessions/{sid}/reward", json=bad, headers=session_auth(session)
            )
            assert response.status_code == 400 and "error" in response.json()
        nan = await http.post(
            f"/sessions/{sid}/reward", content=b'{"reward": NaN}', headers=session_auth(session)
        )
        assert nan.status_code == 400
        huge = await http.post(
            f"/s/{sid}/v1/chat/completions",
            content=b"x" * (5 * 1024 * 1024),
            headers=session_auth(session),
        )
        assert huge.status_code == 413
        bad_ids = await http.post(
            f"/s/{sid}/v1/completions",
            json={"model": "policy", "prompt": [1, 10**9]},
            headers=session_auth(session),
        )
        assert bad_ids.status_code == 400
        empty = await http.post(
            f"/s/{sid}/v1/completions",
            json={"model": "policy", "prompt": ""},
            headers=session_auth(session),
        )
        assert empty.status_code == 400
        assert await trajectory_events(bus) == before
        assert (
            await http.post(f"/sessions/{sid}/finish", headers=session_auth(session))
        ).status_code == 200
        again = await http.post(
            f"/s/{sid}/v1/chat/completions", json=chat, headers=session_auth(session)
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_finished"
        assert (
            await http.post(f"/sessions/{sid}/finish", headers=session_auth(session))
        ).status_code == 409
        missing = await http.get("/no/such/route")
        assert missing.status_code == 404 and "error" in missing.json()


async def test_an_episode_reports_step_rewards_and_a_failure_reason(
    gateway_url: str, bus: Bus
) -> None:
    """An environment's per-step rewards travel with the reward; a failed episode's
    finish carries its reason. Bad values are 400s that store nothing, and the session
    can still be finished after them."""
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
        sid, auth = session["session_id"], session_auth(session)
        before = await trajectory_events(bus)
        for bad in (
            {"reward": 1.0, "step_rewards": [0.1, "x"]},
            {"reward": 1.0, "step_rewards": 0.5},
            {"reward": 1.0, "step_rewards": [0.0] * 5000},
        ):
            response = await http.post(f"/sessions/{sid}/reward", json=bad, headers=auth)
            assert response.status_code == 400 and "error" in response.json(), bad
        nan = await http.post(
            f"/sessions/{sid}/reward",
            content=b'{"reward": 1.0, "step_rewards": [NaN]}',
            headers=auth,
        )
        assert nan.status_code == 400
        for bad_finish in ({"failure": "Env Timeout!"}, {"failure": 3}, {"reason": "x"}):
            response = await http.post(f"/sessions/{sid}/finish", json=bad_finish, headers=auth)
            assert response.status_code == 400 and "error" in response.json(), bad_finish
        assert await trajectory_events(bus) == before
        rewarded = await http.post(
            f"/sessions/{sid}/reward",
            json={"reward": 1.2, "step_rewards": [0.1, 0.1, 1.0]},
            headers=auth,
        )
        assert rewarded.status_code == 200, rewarded.text
        failed = await http.post(
            f"/sessions/{sid}/finish", json={"failure": "env_lost"}, headers=auth
        )
        assert failed.status_code == 200, failed.text
    events = [e for e in await trajectory_events(bus) if getattr(e, "session_id", "") == sid]
    reward = next(e for e in events if isinstance(e, RewardReported))
    finish = next(e for e in events if isinstance(e, SessionFinished))
    assert reward.reward == 1.2 and reward.step_rewards == [0.1, 0.1, 1.0]
    assert finish.failure == "env_lost"


async def test_the_sdk_raises_not_found_for_an_unknown_model(gateway_url: str) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
    async with AsyncOpenAI(
        base_url=session["base_url"], api_key=session["api_key"], max_retries=0
    ) as client:
        with pytest.raises(NotFoundError, match="does not exist"):
            await client.chat.completions.create(
                model="gpt-9", messages=[{"role": "user", "content": "hi"}]
            )


async def test_export_shows_every_branch_with_exact_engine_ids(
    mesh, gateway_url: str, nats_url: str, run_id: str
) -> None:  # type: ignore[no-untyped-def]
    from sf_trajectory.service import TrajectoryService

    trajectory = await mesh.start(TrajectoryService())
    await asyncio.wait_for(trajectory.ready.wait(), 30)
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http, reference="4", reward_fn="integer_match")
        sid = session["session_id"]
        async with AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            first = [{"role": "user", "content": "What is 2 + 2?"}]
            a1 = await client.chat.completions.create(model="policy", messages=first, max_tokens=4)  # type: ignore[arg-type]
            reply1 = {"role": "assistant", "content": a1.choices[0].message.content}
            second = [*first, reply1, {"role": "user", "content": "Sure?"}]
            await client.chat.completions.create(model="policy", messages=second, max_tokens=4)  # type: ignore[arg-type]
            edited = [
                *first,
                {"role": "assistant", "content": "five"},
                {"role": "user", "content": "Sure?"},
            ]
            await client.chat.completions.create(model="policy", messages=edited, max_tokens=4)  # type: ignore[arg-type]
        assert (
            await http.post(f"/sessions/{sid}/finish", headers=session_auth(session))
        ).status_code == 200
        exported = (await http.get(f"/sessions/{sid}/export", headers=session_auth(session))).json()
        missing = await http.get("/sessions/snope/export")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "session_not_found"

    samples = exported["samples"]
    assert exported["finished"] and len(samples) == 2  # the edit forked the session
    kept, final = samples
    assert not kept["final"] and final["final"] and final["reward"] in (0.0, 1.0)
    assert kept["turn_indexes"] == [0, 1], "turn 2 continued turn 1's exact ids"
    assert final["turn_indexes"] == [2]
    # the CLI prints the same export
    result = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sf_app",
        "export",
        sid,
        "--run-id",
        run_id,
        "--nats-url",
        nats_url,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await result.communicate()
    assert result.returncode == 0 and json.loads(out)["samples"] == samples


# ------------------------------------------------------------------ OpenAI compatibility


async def recorded_turns(bus: Bus, session_id: str) -> list[TurnRecorded]:
    return [
        e
        for e in await trajectory_events(bus)
        if isinstance(e, TurnRecorded) and e.session_id == session_id
    ]


async def open_client(http: httpx.AsyncClient) -> tuple[str, AsyncOpenAI]:
    session = await new_session(http)
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    return session["session_id"], client


QUESTION = [{"role": "user", "content": "What is 3 + 5?"}]


async def test_streamed_text_equals_non_streamed_and_the_record(gateway_url: str, bus: Bus) -> None:
    ask = {"model": "policy", "messages": QUESTION, "max_tokens": 12, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        sid, client = await open_client(http)
        async with client:
            whole = await client.chat.completions.create(**ask, seed=3)  # type: ignore[call-overload]
            stream = await client.chat.completions.create(
                **ask, seed=3, stream=True, stream_options={"include_usage": True}, logprobs=True
            )  # type: ignore[call-overload]
            chunks = [chunk async for chunk in stream]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    streamed = "".join(d.content or "" for d in deltas)
    assert streamed == whole.choices[0].message.content  # same seed, same answer
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    first, second = await recorded_turns(bus, sid)
    assert streamed == second.completion_text and first.completion_ids == second.completion_ids
    assert usage.completion_tokens == len(second.completion_ids)
    assert usage.prompt_tokens == len(second.prompt_ids)
    logprobs = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content or []]  # fmt: skip
    assert logprobs == pytest.approx(second.logprobs)


async def test_the_sync_client_in_a_thread_streams_too(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)

    def agent() -> tuple[str, str]:
        with OpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ) as client:
            ask = {"model": "policy", "messages": QUESTION, "max_tokens": 8, "seed": 11}
            whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
            pieces = client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
            streamed = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
            text = client.completions.create(model="policy", prompt=[5, 6], max_tokens=4, seed=2)
            streamed_text = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model="policy", prompt=[5, 6], max_tokens=4, seed=2, stream=True
                )
            )
            assert text.choices[0].text == streamed_text
            return whole.choices[0].message.content or "", streamed

    whole, streamed = await asyncio.to_thread(agent)
    assert whole == streamed
    turns = await recorded_turns(bus, session["session_id"])
    assert len(turns) == 4 and turns[1].completion_text == streamed


async def test_n_choices_are_sibling_turns(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        sid, client = await open_client(http)
        async with client:
            reply = await client.chat.completions.create(
                model="policy",
                messages=QUESTION,
                max_tokens=6,
                n=3,
                seed=5,  # type: ignore[arg-type]
            )
            streamed = await client.chat.completions.create(
                model="policy",
                messages=QUESTION,
                max_tokens=6,
                n=3,
                seed=5,
                stream=True,  # type: ignore[arg-type]
            )
            texts = ["", "", ""]
            async for chunk in streamed:
                for choice in chunk.choices:
                    texts[choice.index] += choice.delta.content or ""
    assert [c.index for c in reply.choices] == [0, 1, 2]
    turns = await recorded_turns(bus, sid)
    assert len(turns) == 6 and [t.turn_index for t in turns] == list(range(6))
    assert len({tuple(t.prompt_ids) for t in turns}) == 1  # siblings: one prompt
    assert [c.message.content for c in reply.choices] == [t.completion_text for t in turns[:3]]
    assert texts == [t.completion_text for t in turns[3:]]
    assert reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(t.completion_ids) for t in turns[:3])


async def test_top_logprobs_shape_and_consistency(gateway_url: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        sid, client = await open_client(http)
        async with client:
            reply = await client.chat.completions.create(
                model="policy",
                messages=QUESTION,
                max_tokens=8,
                temperature=0,  # greedy: the chosen token is always listed (no flaky sampling)
                logprobs=True,
                top_logprobs=4,  # type: ignore[arg-type]
            )
            legacy = await client.completions.create(
                model="policy", prompt="What is 1 + 1?", max_tokens=5, logprobs=3
            )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    turn = (await recorded_turns(bus, sid))[0]
    assert content is not None and len(content) == len(turn.completion_ids)
    listed_once = False
    for entry, logprob in zip(content, turn.logprobs, strict=True):
        assert entry.logprob == pytest.approx(logprob)
        assert len(entry.top_logprobs) == 4
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0
        for top in entry.top_logprobs:
            if top.token == entry.token:  # the chosen token's logprob, when listed
                assert top.logprob == pytest.approx(entry.logprob)
                listed_once = True
    assert listed_once
    logprobs = legacy.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.tokens or []) == len(logprobs.top_logprobs)
    assert all(len(top) <= 3 for top in logprobs.top_logprobs)


async def test_a_client_that_leaves_before_its_body_arrives_is_not_an_error(
    gateway_url: str, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent stopped mid-request (Ctrl-C of a run): the gateway drops the request
    quietly (no stack trace in its log, nothing stored) and keeps serving."""
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
    before = len(await trajectory_events(bus))
    host, port = gateway_url.removeprefix("http://").split(":")
    _reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST /s/{session['session_id']}/v1/chat/completions HTTP/1.1\r\n"
        f"Host: {host}\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
        '{"model": "policy", "messages": ['.encode()
    )
    await writer.drain()
    await asyncio.sleep(0.2)  # the handler is waiting for the rest of the body
    writer.close()
    await writer.wait_closed()
    # time for the gateway to see the disconnect: what must not follow is a logged trace
    await asyncio.sleep(0.3)
    assert not [r for r in caplog.records if r.exc_info], "a stack trace was logged"
    assert len(await trajectory_events(bus)) == before
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        assert (await http.get("/v1/models")).status_code == 200


async def test_a_session_key_opens_its_own_session_and_no_other(gateway_url: str, bus: Bus) -> None:
    """Each session has its own key: without it, or with another session's, every route
    of the session is a 401 with an OpenAI-style body and nothing is stored."""
    chat = {"model": "policy", "messages": [{"role": "user", "content": "1 + 1?"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        mine, theirs = await new_session(http), await new_session(http)
        sid = mine["session_id"]
        before = await trajectory_events(bus)
        for headers in ({}, session_auth(theirs), {"authorization": "Basic abc"}):
            attempts = [
                http.post(f"/s/{sid}/v1/chat/completions", json=chat, headers=headers),
                http.post(f"/s/{sid}/v1/completions", json={"model": "policy", "prompt": "1"},
                          headers=headers),
                http.get(f"/s/{sid}/v1/models", headers=headers),
                http.post(f"/sessions/{sid}/reward", json={"reward": 1.0}, headers=headers),
                http.post(f"/sessions/{sid}/finish", headers=headers),
                http.get(f"/sessions/{sid}/export", headers=headers),
            ]  # fmt: skip
            for response in await asyncio.gather(*attempts):
                assert response.status_code == 401, (response.request.url, response.text)
                error = response.json()["error"]
                assert (
                    error["code"] == "invalid_api_key" and error["type"] == "authentication_error"
                )
        assert await trajectory_events(bus) == before
        # the raw key never leaves the gateway: the durable record holds its digest
        opened = [e for e in before if isinstance(e, SessionOpened) and e.session_id == sid]
        assert opened[0].key_sha256 and mine["api_key"] not in json.dumps(
            [msgspec.to_builtins(e) for e in before]
        )
        # its own key works (an OpenAI client sends it as its api_key)
        async with AsyncOpenAI(
            base_url=mine["base_url"], api_key=mine["api_key"], max_retries=0
        ) as client:
            assert [m.id for m in (await client.models.list()).data] == ["policy"]
        assert (await http.post(f"/sessions/{sid}/finish", headers=session_auth(mine))).is_success


async def test_operator_keys_guard_opening_sessions(mesh, bus: Bus) -> None:  # type: ignore[no-untyped-def]
    """With ``SF_GATEWAY_API_KEYS`` only an operator opens sessions and lists models; an
    operator key exports any session but is not a session key."""
    gateway = await mesh.start(
        GatewayService(GatewaySettings(port=0, api_keys=SecretStr("op-1, op-2")))
    )
    await asyncio.wait_for(gateway.ready.wait(), 30)
    operator = {"authorization": "Bearer op-2"}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.bound_port}") as http:
        for headers in ({}, {"authorization": "Bearer op-3"}):
            assert (await http.post("/sessions", json={}, headers=headers)).status_code == 401
            assert (await http.get("/v1/models", headers=headers)).status_code == 401
        assert await trajectory_events(bus) == []
        assert (await http.get("/v1/models", headers=operator)).status_code == 200
        created = await http.post("/sessions", json={}, headers=operator)
        assert created.status_code == 201
        session = created.json()
        sid = session["session_id"]
        finish = await http.post(f"/sessions/{sid}/finish", headers=operator)
        assert finish.status_code == 401  # an operator key is not this session's key
        assert (
            await http.post(f"/sessions/{sid}/finish", headers=session_auth(session))
        ).is_success
        # export goes to the trajectory service (not running here): past the key check
        exported = await http.get(f"/sessions/{sid}/export", headers=operator)
        assert exported.status_code == 503, exported.text
    assert "op-2" not in repr(gateway.settings) and "op-2" not in str(gateway.settings.api_keys)


async def test_finished_sessions_leave_memory_and_still_answer(mesh, bus: Bus) -> None:  # type: ignore[no-untyped-def]
    """A finished session drops its conversation: only its id and key digest stay, for a
    bounded number of sessions, so a gateway running for weeks does not grow."""
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, finished_sessions_kept=2)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{gateway.bound_port}") as http:
        sessions = [await new_session(http) for _ in range(3)]
        for session in sessions:
            finished = await http.post(
                f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
            )
            assert finished.status_code == 200
        assert gateway.gateway.sessions == {}
        oldest, *kept = sessions
        for session in kept:
            url = f"/s/{session['session_id']}/v1/chat/completions"
            late = await http.post(url, json=chat, headers=session_auth(session))
            assert late.status_code == 409, late.text
            assert (await http.post(url, json=chat)).status_code == 401  # still its key only
        forgotten = await http.post(
            f"/s/{oldest['session_id']}/v1/chat/completions",
            json=chat,
            headers=session_auth(oldest),
        )
        assert forgotten.status_code == 404
    assert list(gateway.gateway.finished) == [s["session_id"] for s in kept]


async def test_a_session_opened_the_moment_the_gateway_listens_gets_a_callable_base_url(
    mesh,
) -> None:  # type: ignore[no-untyped-def]
    """The public URL is known before the first request can arrive (it was set by a task
    polling uvicorn's `started`, so a session opened at once got a relative base_url)."""
    port = free_port()
    await mesh.start(TagSchedulerService())
    service = await mesh.start(GatewayService(GatewaySettings(port=port, max_context=128)))
    async with asyncio.timeout(60):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.001)
                continue
            writer.close()
            await writer.wait_closed()
            break
    assert service.gateway.public_url == f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        session = await new_session(http)
    assert session["base_url"] == (f"http://127.0.0.1:{port}/s/{session['session_id']}/v1")


async def test_a_port_in_use_is_one_unrecoverable_line(mesh) -> None:  # type: ignore[no-untyped-def]
    import socket

    from seamlessflow.bus import Unrecoverable

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        await mesh.start(GatewayService(GatewaySettings(port=port)))
        _, ctx, running = mesh.running.pop()
        with pytest.raises(
            Unrecoverable, match=f"cannot listen on 127.0.0.1:{port}.*SF_GATEWAY_PORT"
        ):
            await asyncio.wait_for(running, 60)
        await ctx.bus.drain()
