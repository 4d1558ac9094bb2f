"""A session's weight-version floor (``min_version``): what makes a synchronous run
on-policy. The H100 run found engines serving the first requests of a batch on the
version before the one the trainer had just published (they were still loading it);
the trajectory service now names the published version in each assignment, the runner
opens the session with it, the gateway puts it on every engine call of the task's
policy, and an engine behind it catches up before it starts the request.

Also here, on the same mesh: a session the broker cannot record (what a cluster losing
a node showed) is a 503 the client retries, and stores nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI

from seamlessflow.bus import Bus
from sf_engine.service import EngineService
from sf_engine.settings import EngineSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_tag_scheduler.service import TagSchedulerService
from sf_weight_sync.service import WeightSyncService
from tests.support import InProcessMesh, publish_perturbed_version, recorded_turns

# real nats-server, real HTTP (see conftest)
pytestmark = pytest.mark.integration


def base_state(model_dir: Path) -> dict:  # type: ignore[type-arg]
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


async def start_mesh(mesh: InProcessMesh) -> str:
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    # the scripted engine: deterministic tokens, no model compute; versions are real
    engine = await mesh.start(EngineService(EngineSettings(engine_id="e", backend="scripted")))
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0)))
    async with asyncio.timeout(60):
        await engine.ready.wait()
        await gateway.ready.wait()
    return f"http://127.0.0.1:{gateway.bound_port}"


async def ask(http: httpx.AsyncClient, body: dict) -> list[int]:  # type: ignore[type-arg]
    session = (await http.post("/sessions", json=body)).json()
    client = AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"])
    try:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    finally:
        await client.close()
    return [session["session_id"]]


async def test_an_engine_behind_the_floor_catches_up_before_it_answers(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        url = await start_mesh(mesh)
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            # no floor: served at once, on the version the engine holds (0)
            await ask(http, {})
            # a floor the engine does not hold yet: the answer waits for version 1,
            # published only after the request reached the engine
            call = asyncio.create_task(ask(http, {"min_version": 1}))
            await asyncio.sleep(0.5)
            assert not call.done()
            await publish_perturbed_version(bus, 1, base_state(base_model_dir))
            async with asyncio.timeout(30):
                await call
            bad = await http.post("/sessions", json={"min_version": -1})
    finally:
        await mesh.stop()
    first, second = await recorded_turns(bus)
    assert set(first.versions) == {0}
    assert set(second.versions) == {1}  # not one token on the version before
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "min_version"


async def test_a_session_the_broker_cannot_record_is_a_503_and_stores_nothing(
    nats_url: str, run_id: str, base_model_dir: Path, bus: Bus
) -> None:
    """JetStream not taking the session's record (here: its stream is gone; in a
    cluster: a leader election) answers 503 with an OpenAI-style body, which clients
    retry, not a 500 with a traceback; the gateway holds no session for it."""
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        url = await start_mesh(mesh)
        await bus.js.delete_stream(bus.subjects.stream_trajectory())
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            refused = await http.post("/sessions", json={})
            health = (await http.get("/healthz")).json()
    finally:
        await mesh.stop()
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "broker_unavailable"
    assert health["sessions"] == 0
