"""A killed engine's requests finish elsewhere: nothing waits for a dead engine.

Engine A is a real OS process, killed with SIGKILL while it holds answers; engine B
runs in-process. The tag-scheduler declares A dead from its missing heartbeats and the
gateway re-submits A's requests (prompt + the tokens already streamed) to B.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
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
from sf_tag_scheduler.settings import TagSchedulerSettings
from sf_weight_sync.service import WeightSyncService

AGENTS = 8
MAX_TOKENS = 200


async def start_engine_process(
    engine_id: str, nats_url: str, run_id: str, model_dir: Path, logs: Path, **env: str
) -> asyncio.subprocess.Process:
    """An engine worker as its own OS process (``python -m sf_engine``)."""
    settings = {
        "SF_NATS_URL": nats_url,
        "SF_RUN_ID": run_id,
        "SF_MODEL_DIR": str(model_dir),
        "SF_ENGINE_ENGINE_ID": engine_id,
        **env,
    }
    with (logs / f"{engine_id}.log").open("wb") as log:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sf_engine",
            env={**os.environ, **settings},
            stdout=log,
            stderr=log,
        )


async def test_requests_on_a_killed_engine_finish_on_another(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus, tmp_path: Path
) -> None:
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    engine_a = await start_engine_process(
        "engine-a",
        nats_url,
        run_id,
        chatty_model_dir,
        tmp_path,
        SF_ENGINE_BATCH_SIZE=str(AGENTS),
    )
    try:
        scheduler = await mesh.start(
            TagSchedulerService(TagSchedulerSettings(dead_after_s=1.5, check_interval_s=0.2))
        )
        await mesh.start(WeightSyncService())
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=512)))
        async with asyncio.timeout(90):
            await gateway.ready.wait()
            while "engine-a" not in scheduler.resources:  # noqa: ASYNC110 (another process)
                await asyncio.sleep(0.1)
        url = f"http://127.0.0.1:{gateway.bound_port}"

        async def agent(index: int, http: httpx.AsyncClient) -> str:
            session = (await http.post("/sessions", json={})).json()
            async with AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"], max_retries=0
            ) as client:
                reply = await client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": f"Count to {index}"}],
                    max_tokens=MAX_TOKENS,
                    stream=index % 2 == 1,  # type: ignore[arg-type]
                )
                if index % 2:
                    text = "".join(
                        [
                            c.choices[0].delta.content or ""
                            async for c in reply  # type: ignore[union-attr]
                            if c.choices
                        ]
                    )
                else:
                    text = reply.choices[0].message.content  # type: ignore[union-attr]
            return text

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            agents = [asyncio.create_task(agent(i, http)) for i in range(AGENTS)]
            # answers are on engine A (the only one) and have started streaming; some
            # may already have ended (a stop token), so wait for any, then kill A
            async with asyncio.timeout(60):
                while not gateway.gateway.engines._engine_calls.get("engine-a"):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            engine_a.send_signal(signal.SIGKILL)
            await engine_a.wait()
            held_by_dead_engine = len(gateway.gateway.engines._engine_calls.get("engine-a", {}))
            engine_b = await mesh.start(EngineService(EngineSettings(engine_id="engine-b")))
            async with asyncio.timeout(120):
                texts = await asyncio.gather(*agents)
        assert engine_b.ready.is_set()
        assert held_by_dead_engine >= 1 and gateway.gateway.engines.reroutes >= 1
    finally:
        if engine_a.returncode is None:
            engine_a.kill()
            await engine_a.wait()
        await mesh.stop()

    from tests.support import recorded_turns

    turns = await recorded_turns(bus)
    assert len(turns) == AGENTS and all(isinstance(t, str) for t in texts)
    for turn in turns:
        # one answer per agent, made by both engines, exactly as recorded
        assert turn.completion_text in texts
        assert len(turn.completion_ids) == len(turn.logprobs) == len(turn.versions)
    assert any(t.engine_id == "engine-b" for t in turns)


async def test_a_request_no_engine_confirms_is_resubmitted(
    nats_url: str, run_id: str, chatty_model_dir: Path, bus: Bus, tmp_path: Path
) -> None:
    """A frozen engine (SIGSTOP: its socket still takes requests, it never answers) is
    not yet declared dead; requests NATS hands it are never confirmed and are
    re-submitted after ``first_chunk_timeout_s`` instead of waiting for the reply
    time-out. Nothing waits on an engine that does not work."""
    from tests.support import InProcessMesh

    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    frozen = await start_engine_process(
        "engine-frozen", nats_url, run_id, chatty_model_dir, tmp_path
    )
    try:
        # liveness far longer than the test: only the first-chunk time-out can help
        scheduler = await mesh.start(TagSchedulerService(TagSchedulerSettings(dead_after_s=600)))
        await mesh.start(WeightSyncService())
        live = await mesh.start(EngineService(EngineSettings(engine_id="engine-live")))
        gateway = await mesh.start(
            GatewayService(
                GatewaySettings(
                    port=0, max_context=512, first_chunk_timeout_s=1.0, generate_timeout_s=300
                )
            )
        )
        frozen_log = tmp_path / "engine-frozen.log"
        async with asyncio.timeout(90):
            await live.ready.wait()
            await gateway.ready.wait()
            # In the queue: "idle" alone is also the phase of an engine that caught up but
            # waits for its rollout role, before it subscribes (under load, long enough
            # for every request to go to the live engine). It logs once it subscribed.
            while b"engine-frozen serving version" not in frozen_log.read_bytes() or (  # noqa: ASYNC110
                scheduler.resources["engine-frozen"].phase != "idle"
            ):
                await asyncio.sleep(0.1)
        frozen.send_signal(signal.SIGSTOP)
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def ask(index: int) -> str:
                session = (await http.post("/sessions", json={})).json()
                async with AsyncOpenAI(
                    base_url=session["base_url"], api_key=session["api_key"], max_retries=0
                ) as client:
                    reply = await client.chat.completions.create(
                        model="policy",
                        messages=[{"role": "user", "content": f"Count to {index}"}],
                        max_tokens=8,
                    )
                return reply.choices[0].message.content or ""

            async with asyncio.timeout(60):  # far below the 300 s reply time-out
                await asyncio.gather(*(ask(i) for i in range(16)))
        # the queue group sent some of the 16 (each with odds 1/2) to the frozen engine;
        # all of them were re-submitted
        assert gateway.gateway.engines.reroutes >= 1
        assert scheduler.resources["engine-frozen"].alive  # never declared dead
    finally:
        if frozen.returncode is None:
            frozen.send_signal(signal.SIGCONT)
            frozen.kill()
            await frozen.wait()
        await mesh.stop()


async def test_an_engine_that_reconnected_has_its_requests_rerouted(
    nats_url: str,
    run_id: str,
    chatty_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An engine whose NATS server went away while it held a confirmed request: the
    tokens it sent meanwhile, its reply included, are lost (written into the dead
    server's socket), then it reconnects. Not dead (its heartbeats come back) and
    confirmed (chunk 0 arrived), the request would wait ``generate_timeout_s`` for
    that reply (what a NATS cluster losing a node showed: 300 s for one call). The
    engine's next heartbeat says it reconnected, and the gateway re-routes the call."""
    from tests.support import InProcessMesh, TcpProxy, eventually, recorded_turns

    monkeypatch.setenv("SF_ENGINE_SCRIPTED_STEP_S", "0.05")  # 40 tokens: ~2 s
    host, _, port = nats_url.removeprefix("nats://").rpartition(":")
    proxy = TcpProxy(host, int(port))
    proxy_url = f"nats://127.0.0.1:{await proxy.start()}"
    mesh = InProcessMesh(nats_url, run_id, chatty_model_dir)
    behind_proxy = InProcessMesh(proxy_url, run_id, chatty_model_dir)
    try:
        # liveness and the first-chunk and reply time-outs all far longer than the test
        await mesh.start(TagSchedulerService(TagSchedulerSettings(dead_after_s=600)))
        await mesh.start(WeightSyncService())
        gateway = await mesh.start(
            GatewayService(
                GatewaySettings(
                    port=0, max_context=512, first_chunk_timeout_s=300, generate_timeout_s=300
                )
            )
        )
        engine = await behind_proxy.start(
            EngineService(EngineSettings(engine_id="engine-x", backend="scripted"))
        )
        async with asyncio.timeout(90):
            await engine.ready.wait()
            await gateway.ready.wait()
        engines = gateway.gateway.engines
        url = f"http://127.0.0.1:{gateway.bound_port}"
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            session = (await http.post("/sessions", json={})).json()
            async with AsyncOpenAI(
                base_url=session["base_url"], api_key=session["api_key"], max_retries=0
            ) as client:
                call = asyncio.create_task(
                    client.chat.completions.create(
                        model="policy",
                        messages=[{"role": "user", "content": "Count"}],
                        max_tokens=40,
                    )
                )
                await eventually(lambda: engines._engine_calls.get("engine-x"), 30, "confirmed")
                proxy.losing = True  # the engine's server "dies": what it sends is lost
                await eventually(lambda: not len(engine._in_flight), 30, "the engine answered")
                assert not call.done()  # its reply was lost
                proxy.cut()  # the engine reconnects (through the proxy, which passes again)
                async with asyncio.timeout(60):  # far below the 300 s reply time-out
                    reply = await call
        assert engines.reroutes >= 1
    finally:
        await behind_proxy.stop()
        await mesh.stop()
        await proxy.close()

    (turn,) = await recorded_turns(bus)
    # the answer the client got is the one recorded, made of both engine calls' tokens
    assert turn.completion_text == reply.choices[0].message.content
    assert len(turn.completion_ids) == len(turn.logprobs) == reply.usage.completion_tokens
