"""The CLI and the service skeleton with other processes: ``serve`` refuses an unknown
service, a service started alone serves and drains on SIGTERM, and a request that times
out because the NATS server left is the stop, not a failure. The configuration doc,
``--help`` and the service table are tests/unit/test_cli_and_service_table.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import ResourceRegister, RoleAssignment, Subjects, decode, encode
from seamlessflow.service import ServiceContext, run_service
from seamlessflow.settings import MeshSettings
from sf_app.cli import SERVICE_NAMES
from tests.support import eventually


@pytest.mark.integration  # a child process
def test_serve_refuses_an_unknown_service() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", "nope"], capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "unknown service" in result.stderr


async def test_a_service_started_alone_serves_and_drains_on_sigterm(
    nats_url: str, run_id: str, tmp_path: Path
) -> None:
    assert "tag-scheduler" in SERVICE_NAMES
    env = {**os.environ, "SF_NATS_URL": nats_url, "SF_RUN_ID": run_id, "SF_RUN_DIR": str(tmp_path)}
    log_path = tmp_path / "service.log"
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sf_tag_scheduler",
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    nc = await nats.connect(nats_url)
    try:
        subject = Subjects(run_id).sched_register()
        request = encode(ResourceRegister(resource_id="engine-x", kind="engine", tags=["rollout"]))
        deadline = time.monotonic() + 60
        while True:
            try:
                reply = decode((await nc.request(subject, request, timeout=1)).data, RoleAssignment)
                break
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                assert time.monotonic() < deadline, "the service never answered"
        assert reply.role == "rollout"

        # SIGTERM again and again until it exits, as an impatient supervisor would: a
        # signal in any phase of the shutdown (draining, closing the connection, flushing
        # the spans) is harmless, and the exit code stays 0. os.kill, not send_signal:
        # Popen.send_signal polls the child first (waitpid), and a poll that reaps it
        # before asyncio's watcher does leaves the watcher an "unknown child" (code 255)
        async def keep_signalling() -> None:
            while process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)
                await asyncio.sleep(0.002)

        signals = asyncio.create_task(keep_signalling())
        try:
            assert await asyncio.wait_for(process.wait(), 30) == 0
        finally:
            signals.cancel()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await nc.close()
    output = log_path.read_text()
    assert "stopping: draining" in output
    spans = list((tmp_path / "spans").glob("tag-scheduler-*.jsonl"))
    assert spans, "the skeleton must flush the span file on shutdown"


class _RequestsAfterTheServerLeft:
    """A service whose request (as a consumer's set-up is) goes out after the NATS server
    left: it times out. With ``after_stop`` it is its last act once asked to stop."""

    name = "requests-after-the-server-left"

    def __init__(self, after_stop: bool) -> None:
        self.after_stop = after_stop
        self.running = asyncio.Event()
        self.server_gone = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        self.running.set()
        await self.server_gone.wait()
        await eventually(
            lambda: not ctx.bus.nc.is_connected, 30, "the client to see the server leave"
        )
        if self.after_stop:
            await ctx.stopping.wait()
        await ctx.bus.nc.request("sf.test.nobody", b"", timeout=0.5)


@pytest.mark.integration  # a nats-server of its own
@pytest.mark.parametrize("after_stop", [True, False])
async def test_a_request_that_times_out_because_the_server_left_is_the_stop_not_a_failure(
    tmp_path: Path, after_stop: bool
) -> None:
    """A service stopped while NATS is gone, in the middle of a request, stops (the CI
    once saw weight-sync exit 1 there, its durable consumer being set up); the same
    timeout without a stop asked is still a failure."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    mesh = MeshSettings(nats_url=server.url, run_id="gone", drain_timeout_s=5.0)
    service = _RequestsAfterTheServerLeft(after_stop)
    # run_service ignores SIGTERM once it stops (a process on its way out); this process
    # goes on, and children it starts later would inherit the ignored signal
    sigterm = signal.getsignal(signal.SIGTERM)
    running = asyncio.create_task(run_service(service, mesh))
    try:
        async with asyncio.timeout(30):
            await service.running.wait()
        server.stop()
        service.server_gone.set()
        async with asyncio.timeout(30):
            if after_stop:
                os.kill(os.getpid(), signal.SIGTERM)  # its handler sets ctx.stopping
                await running  # returns: the stop, no error
            else:
                with pytest.raises(nats.errors.TimeoutError):
                    await running
    finally:
        server.stop()
        running.cancel()
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await running  # its own finally has run: the handler below stays
        signal.signal(signal.SIGTERM, sigterm)
