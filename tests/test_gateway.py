"""The gateway over real HTTP, with a real engine worker, scheduler and weight-sync on a
real nats-server; agents are the official openai SDK."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError
from transformers import AutoTokenizer

from seamlessflow.bus import Bus
from seamlessflow.protocol import SessionOpened, TrajectoryEvent, TurnRecorded, decode
from sf_gateway.config import EngineSettings, GatewaySettings
from sf_gateway.engine_worker import EngineWorker
from sf_gateway.gateway import GatewayService
from sf_tag_scheduler.service import TagScheduler
from sf_weight_sync.service import WeightSync


@pytest.fixture
async def gateway_url(mesh) -> str:  # type: ignore[no-untyped-def]
    await mesh.start(TagScheduler())
    await mesh.start(WeightSync())
    await mesh.start(EngineWorker(EngineSettings(engine_id="engine-t", max_batch_size=8)))
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=128)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    return f"http://127.0.0.1:{gateway.bound_port}"


async def stored_events(bus: Bus) -> list[Any]:
    s = bus.subjects
    return [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]


async def new_session(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


async def test_an_unmodified_openai_client_only_sets_base_url(
    gateway_url: str, bus: Bus, base_model_dir
) -> None:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http, task_id="t1", reference="4", reward_fn="integer_match")
        client = AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        reply = await client.chat.completions.create(
            model="policy",
            messages=messages,
            max_tokens=6,
            logprobs=True,
            seed=1,  # type: ignore[arg-type]
        )
        models = await client.models.list()
        await client.close()
        assert [m.id for m in models.data] == ["policy"]
        finish = await http.post(f"/sessions/{session['session_id']}/finish")
        assert finish.status_code == 200

    events = await stored_events(bus)
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
        client = AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
        reply = await client.completions.create(model="policy", prompt=[5, 6, 7], max_tokens=3)
        await client.close()
    turn = next(e for e in await stored_events(bus) if isinstance(e, TurnRecorded))
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
    (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "n": 2}', 400, "n"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (
        b'{"model": "policy", "messages": [{"role": "user", "content": "' + b"9 " * 400 + b'"}]}',
        400,
        None,
    ),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_CHAT_REQUESTS)
async def test_bad_chat_requests_get_openai_errors_and_store_nothing(
    gateway_url: str, bus: Bus, body: bytes, status: int, param: str | None
) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
        before = await stored_events(bus)
        response = await http.post(
            f"/s/{session['session_id']}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if param is not None:
        assert param in (error["param"] or "")
    assert await stored_events(bus) == before


async def test_session_errors_and_bad_rewards(gateway_url: str, bus: Bus) -> None:
    chat = {"model": "policy", "messages": [{"role": "user", "content": "1 + 1?"}], "max_tokens": 2}
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        unknown = await http.post("/s/sdoesnotexist/v1/chat/completions", json=chat)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "session_not_found"
        session = await new_session(http)
        sid = session["session_id"]
        before = await stored_events(bus)
        for bad in ({"reward": "high"}, {}, {"reward": 1, "extra": 2}):
            response = await http.post(f"/sessions/{sid}/reward", json=bad)
            assert response.status_code == 400 and "error" in response.json()
        nan = await http.post(f"/sessions/{sid}/reward", content=b'{"reward": NaN}')
        assert nan.status_code == 400
        huge = await http.post(f"/s/{sid}/v1/chat/completions", content=b"x" * (5 * 1024 * 1024))
        assert huge.status_code == 413
        bad_ids = await http.post(
            f"/s/{sid}/v1/completions", json={"model": "policy", "prompt": [1, 10**9]}
        )
        assert bad_ids.status_code == 400
        empty = await http.post(f"/s/{sid}/v1/completions", json={"model": "policy", "prompt": ""})
        assert empty.status_code == 400
        assert await stored_events(bus) == before
        assert (await http.post(f"/sessions/{sid}/finish")).status_code == 200
        again = await http.post(f"/s/{sid}/v1/chat/completions", json=chat)
        assert again.status_code == 409 and again.json()["error"]["code"] == "session_finished"
        assert (await http.post(f"/sessions/{sid}/finish")).status_code == 409
        missing = await http.get("/no/such/route")
        assert missing.status_code == 404 and "error" in missing.json()


async def test_the_sdk_raises_not_found_for_an_unknown_model(gateway_url: str) -> None:
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http)
    client = AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    with pytest.raises(NotFoundError, match="does not exist"):
        await client.chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "hi"}]
        )
    await client.close()


async def test_export_shows_every_branch_with_exact_engine_ids(
    mesh, gateway_url: str, nats_url: str, run_id: str
) -> None:  # type: ignore[no-untyped-def]
    from sf_trajectory.service import TrajectoryService

    trajectory = await mesh.start(TrajectoryService())
    await asyncio.wait_for(trajectory.ready.wait(), 30)
    async with httpx.AsyncClient(base_url=gateway_url) as http:
        session = await new_session(http, reference="4", reward_fn="integer_match")
        sid = session["session_id"]
        client = AsyncOpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
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
        await client.close()
        assert (await http.post(f"/sessions/{sid}/finish")).status_code == 200
        exported = (await http.get(f"/sessions/{sid}/export")).json()
        missing = await http.get("/sessions/snope/export")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"

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
        "seamlessflow",
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
