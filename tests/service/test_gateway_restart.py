"""A restarted gateway continues the sessions that were open on it (docs/design.md,
"Faults"): it rebuilds them from the run's trajectory stream, so an agent's next call
with the same base URL and key goes on from the same stored token ids, and its sample
reaches the trajectory service whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    SessionExport,
    decode,
)
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_trajectory.service import TrajectoryService
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, session_auth, session_turns

# every answer the gateway gives here is checked against the openai types
pytestmark = pytest.mark.usefixtures("openai_shapes")


async def start_gateway(
    nats_url: str, run_id: str, model_dir: Path, port: int
) -> tuple[InProcessMesh, GatewayService]:
    """A gateway of its own (its own process, as far as state goes)."""
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    gateway = await mesh.start(GatewayService(GatewaySettings(port=port, max_context=256)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    return mesh, gateway


async def open_session(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/sessions", json=body)
    assert response.status_code == 201, response.text
    return response.json()  # type: ignore[no-any-return]


@pytest.fixture
async def agents() -> AsyncIterator[list[AsyncOpenAI]]:
    """OpenAI clients closed at the end, whatever happened."""
    clients: list[AsyncOpenAI] = []
    yield clients
    for client in clients:
        await client.close()


async def test_a_restarted_gateway_continues_its_open_sessions_from_the_stream(
    mesh: InProcessMesh,
    nats_url: str,
    run_id: str,
    bus: Bus,
    base_model_dir: Path,
    agents: list[AsyncOpenAI],
) -> None:
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    await mesh.start(EngineService(EngineSettings(engine_id="engine-r", max_batch_size=8)))
    trajectory = await mesh.start(TrajectoryService())
    await asyncio.wait_for(trajectory.ready.wait(), 30)

    first_mesh, first = await start_gateway(nats_url, run_id, base_model_dir, port=0)
    port = first.bound_port
    assert port is not None
    url = f"http://127.0.0.1:{port}"
    question = {"role": "user", "content": "What is 2 + 2?"}
    try:
        async with httpx.AsyncClient(base_url=url) as http:
            kept = await open_session(http, task_id="t1", reference="4", reward_fn="integer_match")
            done = await open_session(http)
            finish = await http.post(
                f"/sessions/{done['session_id']}/finish", headers=session_auth(done)
            )
            assert finish.status_code == 200, finish.text
        agent = AsyncOpenAI(base_url=kept["base_url"], api_key=kept["api_key"], max_retries=0)
        agents.append(agent)
        first_reply = await agent.chat.completions.create(
            model="policy", messages=[question], max_tokens=6, seed=1
        )
    finally:
        await first_mesh.stop()  # the gateway, and every session it held in memory

    # A new gateway instance on the same port: all it knows comes from JetStream.
    second_mesh, second = await start_gateway(nats_url, run_id, base_model_dir, port=port)
    try:
        assert second.gateway is not first.gateway
        assert set(second.gateway.sessions) == {kept["session_id"]}
        assert done["session_id"] in second.gateway.finished
        restored = second.gateway.sessions[kept["session_id"]]
        assert restored.turns == 1 and restored.opened.reference == "4"
        assert restored.opened.reward_fn == "integer_match"

        # the agent goes on as if nothing happened: same client, same base URL and key
        answer = first_reply.choices[0].message.content or ""
        history = [question, {"role": "assistant", "content": answer}]
        second_reply = await agent.chat.completions.create(
            model="policy",
            messages=[*history, {"role": "user", "content": "And 3 + 3?"}],
            max_tokens=6,
            seed=2,
        )
        assert second_reply.choices[0].message.content is not None
        async with httpx.AsyncClient(base_url=url) as http:
            wrong_key = await http.post(
                f"/sessions/{kept['session_id']}/finish", headers=session_auth(done)
            )
            assert wrong_key.status_code == 401, wrong_key.text
            late = await http.post(
                f"/sessions/{done['session_id']}/finish", headers=session_auth(done)
            )
            assert late.status_code == 409, late.text
            # an OpenAI client retries 409s unless told not to (the agent runner's
            # clients retry, to ride out a gateway restart)
            assert late.headers["x-should-retry"] == "false"
            finish = await http.post(
                f"/sessions/{kept['session_id']}/finish", headers=session_auth(kept)
            )
            assert finish.status_code == 200, finish.text
            assert finish.json()["turns"] == 2
            exported = await http.get(
                f"/sessions/{kept['session_id']}/export", headers=session_auth(kept)
            )
            assert exported.status_code == 200, exported.text
    finally:
        await second_mesh.stop()

    # the second turn continued the stored ids of the first (no re-tokenized history)
    first_turn, second_turn = await session_turns(bus, kept["session_id"])
    assert second_turn.turn_index == 1
    stored = [*first_turn.prompt_ids, *first_turn.completion_ids]
    assert second_turn.prompt_ids[: len(stored)] == stored
    assert len(second_turn.prompt_ids) > len(stored)
    # and the trajectory service holds the whole sample: one branch, both turns trained
    export = decode(exported.content, SessionExport)
    assert export.finished
    [sample] = [s for s in export.samples if s.final]
    assert sample.turn_indexes == [0, 1]
    assert sample.token_ids == [*second_turn.prompt_ids, *second_turn.completion_ids]
    trained = [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert trained == [*first_turn.completion_ids, *second_turn.completion_ids]
    assert sample.reward is not None  # integer_match of the reference the session opened with
