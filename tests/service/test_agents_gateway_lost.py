"""An agent whose gateway stops answering mid-conversation: one error line per lost
sample, no traceback (compose: with the gateway down the agents printed 36
tracebacks). The agent's own bugs still get their traceback."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import types
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from seamlessflow.agents import EpisodeFailed
from seamlessflow.bus import Bus
from seamlessflow.protocol import SessionFinished, TrajectoryEvent, decode
from seamlessflow.service import unrecoverable_cause
from sf_agents import service as agent_runner
from sf_agents.service import AgentRunner
from sf_agents.settings import AgentRunnerSettings
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from tests.support import InProcessMesh, announce_plan, free_port

# real nats-server, real HTTP (see conftest)
pytestmark = pytest.mark.integration


async def test_a_lost_gateway_costs_one_line_per_sample_not_a_traceback(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(agent_runner, "AGENT_CALL_RETRIES", 0)  # fail at once
    # sessions open at the gateway, but the base_url it hands out answers nothing: every
    # agent call finds no gateway, as when it stops mid-conversation
    dead = f"http://127.0.0.1:{free_port()}"
    await announce_plan(bus, steps=1)
    mesh = InProcessMesh(nats_url, run_id, base_model_dir)
    try:
        await mesh.start(TrajectoryService(TrajectorySettings(group_size=2, groups_per_batch=1)))
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0, public_url=dead)))
        async with asyncio.timeout(60):
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        runner = AgentRunner(AgentRunnerSettings(gateway_url=url, concurrency=2, max_tokens=4))
        with caplog.at_level(logging.INFO, logger="sf_agents.service"):
            await mesh.start(runner)
            async with asyncio.timeout(120):
                while runner.failed < 2:  # noqa: ASYNC110 (polling the runner under test)
                    await asyncio.sleep(0.1)
    finally:
        await mesh.stop()
    lost = [r for r in caplog.records if "the gateway did not answer" in r.getMessage()]
    assert len(lost) >= 2
    assert all(r.levelno == logging.ERROR and r.exc_info is None for r in lost)
    assert not [r for r in caplog.records if r.exc_info], "no traceback"
    # the lost samples' sessions finished naming why, and are dropped with that reason
    # (a sample still in flight when the mesh stopped finishes without one)
    reasons = list((await finish_reasons(bus)).values())
    assert reasons.count("gateway_lost") >= 2 and set(reasons) <= {"gateway_lost", ""}


async def test_an_agent_that_raises_on_every_sample_stops_the_run_with_one_line(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An agent with a bug that fails every sample: the runner stops after
    ``AGENT_ERRORS_IN_A_ROW`` of them with one line naming the agent and the error,
    instead of claiming and losing samples for as long as the run lasts."""
    monkeypatch.setattr(agent_runner, "AGENT_ERRORS_IN_A_ROW", 4)

    async def misreads_its_answers(client: object, task: object) -> float:
        raise TypeError("the answer is not a float")

    runner, ended = await run_until_it_stops(
        misreads_its_answers, nats_url, run_id, base_model_dir, bus
    )
    # what the service skeleton finds and exits with (EXIT_UNRECOVERABLE, one line)
    stopped = unrecoverable_cause(ended)
    assert stopped is not None, ended
    message = str(stopped)
    assert "raised on 4 samples in a row" in message
    assert "TypeError: the answer is not a float" in message and "'single_turn'" in message
    # the fifth sample may fail beside the fourth, before the runner stops (concurrency 2)
    assert runner.completed == 0 and runner.failed in (4, 5)
    reasons = list((await finish_reasons(bus)).values())
    assert reasons.count("agent_error") == runner.failed
    assert set(reasons) <= {"agent_error", ""}


async def test_an_environment_that_fails_every_episode_stops_the_run_with_one_line(
    nats_url: str,
    run_id: str,
    base_model_dir: Path,
    bus: Bus,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every episode failed by the environment (here: it refuses what the agent sends):
    the runner stops after ``ENV_FAILURES_IN_A_ROW`` (at least eight times its
    concurrency) with one line naming the environment and its last failure."""
    monkeypatch.setattr(agent_runner, "ENV_FAILURES_IN_A_ROW", 4)

    async def refused(client: object, task: object) -> float:
        raise EpisodeFailed("env_error", "VALIDATION_ERROR: Field required")

    runner, ended = await run_until_it_stops(refused, nats_url, run_id, base_model_dir, bus)
    stopped = unrecoverable_cause(ended)
    assert stopped is not None, ended
    message = str(stopped)
    assert "failed 16 episodes in a row, none completed" in message  # 8 x concurrency 2
    assert "env_error: VALIDATION_ERROR: Field required" in message
    assert runner.completed == 0 and runner.failed in (16, 17)
    reasons = list((await finish_reasons(bus)).values())
    assert reasons.count("env_error") == runner.failed


async def run_until_it_stops(
    agent: object, nats_url: str, run_id: str, model_dir: Path, bus: Bus
) -> tuple[AgentRunner, BaseException | None]:
    """A runner (concurrency 2) with ``agent`` against the real gateway and trajectory
    service, until it ends by itself; the runner, and what it ended with."""
    await announce_plan(bus, steps=1)
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    try:
        await mesh.start(TrajectoryService(TrajectorySettings(group_size=2, groups_per_batch=1)))
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0)))
        async with asyncio.timeout(60):
            await gateway.ready.wait()
        url = f"http://127.0.0.1:{gateway.bound_port}"
        runner = AgentRunner(AgentRunnerSettings(gateway_url=url, concurrency=2, max_tokens=4))
        runner.agent = agent  # type: ignore[assignment]
        await mesh.start(runner)
        (_, _, running) = mesh.running.pop()  # it ends by itself: nothing to stop
        async with asyncio.timeout(120):
            ended = (await asyncio.gather(running, return_exceptions=True))[0]
    finally:
        await mesh.stop()
    return runner, ended


async def finish_reasons(bus: Bus) -> dict[str, str]:
    """Each finished session's failure reason, from the trajectory stream."""
    s = bus.subjects
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]
    return {e.session_id: e.failure for e in events if isinstance(e, SessionFinished)}


async def test_the_runner_waits_out_a_gateway_whose_broker_is_electing_a_leader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A NATS cluster that lost a stream's leader answers no publish for a few seconds,
    and the gateway answers 503 meanwhile. The runner's own calls kept trying for five
    attempts only (~2.5 s): in the compose cluster check the sessions it could not open
    were lost until their groups timed out, 10 minutes later. It now keeps trying for
    the policy's time limit: here the gateway is busy for 9 answers, then opens the
    session."""
    policy = agent_runner.GATEWAY_CALL_RETRY
    assert policy.attempts is None and policy.deadline_s is not None
    assert policy.deadline_s >= 60, "longer than a NATS leader election or a broker restart"
    # the same policy with waits shrunk to milliseconds (the count of answers is what
    # the old policy failed on)
    monkeypatch.setattr(
        agent_runner,
        "GATEWAY_CALL_RETRY",
        dataclasses.replace(policy, first_delay_s=0.001, max_delay_s=0.01),
    )
    busy_answers = 9
    calls: list[str] = []

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def open_session(request: web.Request) -> web.Response:
        calls.append(request.path)
        if len(calls) <= busy_answers:
            body = {"error": {"message": "the message broker is unavailable for a moment",
                              "type": "server_error", "code": "broker_unavailable"}}  # fmt: skip
            return web.json_response(body, status=503)
        return web.json_response({"session_id": "s1"}, status=201)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_post("/sessions", open_session)
    server = web.AppRunner(app)
    await server.setup()
    site = web.TCPSite(server, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        runner = AgentRunner(AgentRunnerSettings(gateway_url=f"http://127.0.0.1:{port}"))
        runner.gateway_url = runner.settings.gateway_url
        runner.ctx = types.SimpleNamespace(stopping=asyncio.Event())  # type: ignore[assignment]
        async with aiohttp.ClientSession() as http:
            runner.http = http
            status, body = await runner._post("/sessions", {"task_id": "t"})
    finally:
        await server.cleanup()
    assert status == 201 and json.loads(body)["session_id"] == "s1"
    assert len(calls) == busy_answers + 1


def test_an_episode_failure_names_its_reason_as_the_gateway_takes_it() -> None:
    """A reason the gateway would refuse (400) would leave the session unfinished until
    its group timed out: it is refused where the agent raises it instead."""
    from seamlessflow.agents import EpisodeFailed

    failed = EpisodeFailed("env_lost", "the server closed the WebSocket")
    assert failed.reason == "env_lost" and "closed" in str(failed)
    for bad in ("", "Env Lost", "env-lost", "x" * 65):
        with pytest.raises(ValueError, match="short identifier"):
            EpisodeFailed(bad)
