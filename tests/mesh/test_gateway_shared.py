"""Several gateway processes serving the same sessions (``SF_GATEWAY_SHARED_SESSIONS``,
``SF_GATEWAY_REUSE_PORT``): a session opened on one continues on another turn by turn,
from the exact ids the other stored, and outlives the process that opened it. Each
gateway here has its own connection and state (its own process, as far as state goes).
The settings' own check is tests/unit/test_gateway_shared_settings.py."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

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
from tests.support import InProcessMesh, session_auth, session_turns, small_embedded_run

pytestmark = pytest.mark.usefixtures("openai_shapes")


async def start_gateway(
    nats_url: str, run_id: str, model_dir: Path, **settings: Any
) -> tuple[InProcessMesh, GatewayService]:
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    settings = {"port": 0, "max_context": 256, **settings}
    gateway = await mesh.start(GatewayService(GatewaySettings(**settings)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    return mesh, gateway


def url_of(gateway: GatewayService) -> str:
    return f"http://127.0.0.1:{gateway.bound_port}"


def on(gateway: GatewayService, session: dict[str, Any]) -> AsyncOpenAI:
    """An agent's client for ``session`` pointed at ``gateway`` (what a load balancer in
    front of several processes does to the session's base URL)."""
    base_url = f"{url_of(gateway)}/s/{session['session_id']}/v1"
    return AsyncOpenAI(base_url=base_url, api_key=session["api_key"], max_retries=0)


@pytest.fixture
async def rollout(mesh: InProcessMesh) -> AsyncIterator[None]:
    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    await mesh.start(EngineService(EngineSettings(engine_id="engine-s", max_batch_size=8)))
    yield


async def test_a_session_goes_on_across_gateway_processes_and_outlives_its_opener(
    rollout: None, nats_url: str, run_id: str, bus: Bus, base_model_dir: Path
) -> None:
    first_mesh, first = await start_gateway(nats_url, run_id, base_model_dir, shared_sessions=True)
    second_mesh, second = await start_gateway(
        nats_url, run_id, base_model_dir, shared_sessions=True
    )
    clients: list[AsyncOpenAI] = []
    question = {"role": "user", "content": "What is 2 + 2?"}
    try:
        async with httpx.AsyncClient(base_url=url_of(first)) as http:
            opened = await http.post("/sessions", json={"task_id": "t1"})
            assert opened.status_code == 201, opened.text
            session = opened.json()
        # at once on the other process: it catches up before answering (no 404)
        clients += [on(first, session), on(second, session)]
        on_first, on_second = clients
        reply = await on_second.chat.completions.create(
            model="policy", messages=[question], max_tokens=6, seed=1
        )
        history = [question, {"role": "assistant", "content": reply.choices[0].message.content}]
        follow_up = {"role": "user", "content": "And 3 + 3?"}
        await on_first.chat.completions.create(
            model="policy", messages=[*history, follow_up], max_tokens=6, seed=2
        )
        # the process that opened the session and ran its second turn goes away
        await first_mesh.stop()
        turns = await session_turns(bus, session["session_id"])
        second_answer = turns[1].completion_text
        await on_second.chat.completions.create(
            model="policy",
            messages=[
                *history,
                follow_up,
                {"role": "assistant", "content": second_answer},
                {"role": "user", "content": "And 4 + 4?"},
            ],
            max_tokens=6,
            seed=3,
        )
        async with httpx.AsyncClient(base_url=url_of(second)) as http:
            finish = await http.post(
                f"/sessions/{session['session_id']}/finish", headers=session_auth(session)
            )
        assert finish.status_code == 200, finish.text
        assert finish.json()["turns"] == 3
    finally:
        for client in clients:
            await client.close()
        await first_mesh.stop()
        await second_mesh.stop()

    # three turns, numbered in order wherever they ran, each continuing the exact ids
    # the previous one stored (on the other process)
    turns = await session_turns(bus, session["session_id"])
    assert [t.turn_index for t in turns] == [0, 1, 2]
    for before, after in itertools.pairwise(turns):
        stored = [*before.prompt_ids, *before.completion_ids]
        assert after.prompt_ids[: len(stored)] == stored
        assert after.parent_digest == before.node_digest != ""


async def test_a_gateway_without_shared_sessions_does_not_know_the_others(
    rollout: None, nats_url: str, run_id: str, base_model_dir: Path
) -> None:
    """The control: a process that does not follow the stream answers 404 for a session
    another opened after it started (so the test above depends on the setting)."""
    shared_mesh, shared = await start_gateway(
        nats_url, run_id, base_model_dir, shared_sessions=True
    )
    alone_mesh, alone = await start_gateway(nats_url, run_id, base_model_dir)
    try:
        async with httpx.AsyncClient(base_url=url_of(alone)) as http:
            opened = await http.post("/sessions", json={})
            assert opened.status_code == 201, opened.text
            session = opened.json()
        path = f"/s/{session['session_id']}/tokenize"
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with httpx.AsyncClient(base_url=url_of(shared)) as http:
            seen = await http.post(path, json=body, headers=session_auth(session))
        assert seen.status_code == 200, seen.text
        async with httpx.AsyncClient(base_url=url_of(shared)) as http:
            other = (await http.post("/sessions", json={})).json()
        async with httpx.AsyncClient(base_url=url_of(alone)) as http:
            unseen = await http.post(
                f"/s/{other['session_id']}/tokenize", json=body, headers=session_auth(other)
            )
        assert unseen.status_code == 404, unseen.text
    finally:
        await shared_mesh.stop()
        await alone_mesh.stop()


async def test_processes_with_reuse_port_listen_on_one_port(
    rollout: None, nats_url: str, run_id: str, base_model_dir: Path
) -> None:
    from seamlessflow.natsserver import free_tcp_port

    port = free_tcp_port()
    meshes = []
    try:
        for _ in range(2):
            mesh, gateway = await start_gateway(
                nats_url, run_id, base_model_dir, port=port, reuse_port=True
            )
            meshes.append(mesh)
            assert gateway.bound_port == port
            assert gateway.settings.shared_sessions  # implied
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            opened = await http.post("/sessions", json={})
            assert opened.status_code == 201, opened.text
            session = opened.json()
            # new connections land on either process; every one knows the session
            for _ in range(8):
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as fresh:
                    answer = await fresh.post(
                        f"/s/{session['session_id']}/tokenize",
                        json={"prompt": "hi"},
                        headers=session_auth(session),
                    )
                    assert answer.status_code == 200, answer.text
    finally:
        for mesh in meshes:
            await mesh.stop()


async def test_a_process_behind_on_the_stream_waits_for_the_session_it_is_asked_about(
    rollout: None, nats_url: str, run_id: str, bus: Bus, base_model_dir: Path
) -> None:
    """The catch-up: a process that has not read another's last turn of a session yet
    answers that session only once it has (503 ``catching_up`` if it cannot in
    ``catch_up_timeout_s``), so its turn continues the stored ids, not a re-tokenized
    history. Here the second process is held from recording how far it has read (the
    lock its follower and a catching-up request take) until the test lets go."""
    first_mesh, first = await start_gateway(nats_url, run_id, base_model_dir, shared_sessions=True)
    second_mesh, second = await start_gateway(
        nats_url, run_id, base_model_dir, shared_sessions=True, catch_up_timeout_s=1.0
    )
    clients: list[AsyncOpenAI] = []
    question = {"role": "user", "content": "What is 2 + 2?"}
    held = False
    try:
        async with httpx.AsyncClient(base_url=url_of(first)) as http:
            session = (await http.post("/sessions", json={})).json()
        clients += [on(first, session), on(second, session)]
        on_first, on_second = clients
        await asyncio.wait_for(_known(second, session["session_id"]), 10)
        # from now on the second process cannot record how far it has read the stream
        # (its follower waits for this lock after applying an event; so does a request
        # that must catch up), until the test lets go
        applied = second.gateway.session_table._applied
        await applied.acquire()
        held = True
        reply = await on_first.chat.completions.create(
            model="policy", messages=[question], max_tokens=6, seed=1
        )
        follow_up = [
            question,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "And 3 + 3?"},
        ]
        # not read in time: "send it again"
        async with httpx.AsyncClient(base_url=url_of(second)) as http:
            refused = await http.post(
                f"/s/{session['session_id']}/v1/chat/completions",
                json={"model": "policy", "messages": follow_up, "max_tokens": 6},
                headers=session_auth(session),
            )
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "catching_up"
        # let go while the request waits: it answers, continuing the first turn's node
        asyncio.get_running_loop().call_later(0.3, applied.release)
        held = False
        await on_second.chat.completions.create(
            model="policy", messages=follow_up, max_tokens=6, seed=2
        )
    finally:
        if held:
            applied.release()
        for client in clients:
            await client.close()
        await first_mesh.stop()
        await second_mesh.stop()
    first_turn, second_turn = await session_turns(bus, session["session_id"])
    assert second_turn.turn_index == 1
    assert second_turn.parent_digest == first_turn.node_digest != ""


async def _known(gateway: GatewayService, session_id: str) -> None:
    while session_id not in gateway.gateway.sessions:  # noqa: ASYNC110 (its follower's tables)
        await asyncio.sleep(0.05)


@pytest.mark.slow
async def test_an_embedded_run_with_two_gateway_processes_uses_both(
    run_id: str, tmp_path: Path, base_model_dir: Path
) -> None:
    """``seamlessflow up --gateways 2``: two gateway processes on the run's one port; the
    agents' connections, opened once both listen, are spread over both by the kernel (each
    records chat turns) and the run trains its steps."""
    # 24 agents' connections opened at once: all on one process has odds of 2^-23
    run = small_embedded_run(
        run_id, tmp_path, base_model_dir, steps=3, gateways=2, agent_concurrency=24
    )
    summary = await run.run()
    assert summary.status == "finished", summary.status
    assert summary.final_version == 3
    logs = [(tmp_path / run_id / "logs" / f"gateway-{i}.log").read_text() for i in range(2)]
    listening = [re.search(r"gateway listening on (\S+)", log) for log in logs]
    assert all(listening), logs
    assert listening[0][1] == listening[1][1]  # type: ignore[index]
    chats_by_process = []
    for spans in sorted((tmp_path / run_id / "spans").glob("gateway-*.jsonl")):
        names = [json.loads(line)["name"] for line in spans.read_text().splitlines()]
        chats_by_process.append(names.count("gateway.chat_completion"))
    assert len(chats_by_process) == 2 and all(chats_by_process), chats_by_process
