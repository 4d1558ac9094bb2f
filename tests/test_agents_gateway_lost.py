"""An agent whose gateway stops answering mid-conversation: one error line per lost
sample, no traceback (compose: with the gateway down the agents printed 36
tracebacks). The agent's own bugs still get their traceback."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from conftest import InProcessMesh, announce_plan

from seamlessflow.agents import runner as agent_runner
from seamlessflow.agents.runner import AgentRunner, AgentRunnerSettings
from seamlessflow.bus import Bus
from sf_app.run.supervisor import free_port
from sf_gateway.service import GatewayService
from sf_gateway.settings import GatewaySettings
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings

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
        with caplog.at_level(logging.INFO, logger="seamlessflow.agents.runner"):
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
