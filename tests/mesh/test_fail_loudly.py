"""Failing loudly: a process that cannot reach NATS, or is refused by it, exits within
seconds with one line that says what failed and what to set; CLI commands take the
token from ``SF_NATS_TOKEN`` or a run directory."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from seamlessflow.bus import EXIT_UNRECOVERABLE, ConnectFailed, connect
from seamlessflow.connection import RunConnection
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import Subjects
from tests.support import free_port

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

TOKEN = "t0ken-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A NATS server that takes only ``TOKEN``."""
    with EmbeddedNats(tmp_path_factory.mktemp("token-nats"), token=TOKEN) as server:
        yield server.url


def clean_env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    return {**env, **settings}


@pytest.mark.parametrize("token", ["", "not-the-token"])
async def test_refused_credentials_fail_at_once_and_say_which_setting(
    token_server: str, token: str
) -> None:
    with pytest.raises(ConnectFailed) as refused:
        # far less than the wait: a refusal is not retried
        async with asyncio.timeout(10):
            await connect(token_server, Subjects("r"), name="t", token=token, wait_s=120)
    assert "SF_NATS_TOKEN" in str(refused.value) and token_server in str(refused.value)
    if token:
        assert token not in str(refused.value)


async def test_an_unreachable_server_fails_after_the_wait() -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectFailed) as unreachable:
        async with asyncio.timeout(30):
            await connect(url, Subjects("r"), name="t", wait_s=1.0)
    assert "SF_NATS_URL" in str(unreachable.value) and url in str(unreachable.value)


async def test_the_first_connect_waits_for_a_server_that_comes_up(tmp_path: Path) -> None:
    """Within the wait, an unreachable server is retried (compose starts services and
    NATS together); once connected, the client reconnects without limit."""
    port = free_port()
    server = EmbeddedNats(tmp_path / "late", port=port)
    connecting = asyncio.create_task(
        connect(f"nats://127.0.0.1:{port}", Subjects("r"), name="t", wait_s=60)
    )
    await asyncio.sleep(1.0)  # no server yet: the connect must keep waiting (the subject)
    assert not connecting.done()
    server.start()
    try:
        bus = await asyncio.wait_for(connecting, 30)
        assert bus.nc.options["max_reconnect_attempts"] == -1
        assert bus.nc.options["allow_reconnect"]
        await bus.drain()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ({"SF_NATS_TOKEN": "wrong"}, "refused the token given"),
        ({}, "refused no token"),
    ],
)
def test_a_service_refused_by_nats_exits_with_one_line(
    token_server: str, tmp_path: Path, settings: dict[str, str], expected: str
) -> None:
    env = clean_env(SF_NATS_URL=token_server, SF_RUN_ID="loud", **settings)
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", "tag-scheduler"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,  # today's failure mode is retrying forever
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith("tag-scheduler: NATS at"), result.stderr
    assert expected in lines[-1] and "SF_NATS_TOKEN" in lines[-1]
    assert "Traceback" not in result.stderr


def test_a_service_without_a_server_exits_with_one_line() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    env = clean_env(SF_NATS_URL=url, SF_RUN_ID="loud", SF_NATS_CONNECT_WAIT_S="1")
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", "weight-sync"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"weight-sync: cannot reach NATS at {url}"), result.stderr
    assert "Traceback" not in result.stderr


def export(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sf_app", "export", "s-missing", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_export_takes_the_token_from_the_environment_or_the_run_directory(
    token_server: str, tmp_path: Path
) -> None:
    """Past the server's check, the export asks the trajectory service (none runs
    here, so nobody answers); without the token it says the server refused it."""
    refused = export(env=clean_env(SF_NATS_URL=token_server, SF_RUN_ID="x"))
    assert refused.returncode == 1
    assert "refused no token" in refused.stderr and "SF_NATS_TOKEN" in refused.stderr

    with_token = export(env=clean_env(SF_NATS_URL=token_server, SF_RUN_ID="x", SF_NATS_TOKEN=TOKEN))
    assert with_token.returncode == 1
    assert "no responder" in with_token.stderr, with_token.stderr

    run_dir = tmp_path / "run"
    connection = RunConnection("x", token_server, TOKEN, "http://127.0.0.1:9", "k")
    path = connection.write(run_dir)
    assert path.stat().st_mode & 0o077 == 0  # only its owner reads it
    from_dir = export("--run-dir", str(run_dir), env=clean_env())
    assert from_dir.returncode == 1
    assert "no responder" in from_dir.stderr, from_dir.stderr

    not_a_run = export("--run-dir", str(tmp_path), env=clean_env())
    assert not_a_run.returncode == 2
    assert "connection.json" in not_a_run.stderr


@pytest.mark.parametrize(
    ("service", "settings", "expected"),
    [
        ("gateway", {"SF_GATEWAY_HOST": "0.0.0.0"}, "SF_GATEWAY_PUBLIC_URL"),
        ("trainer", {"SF_STEPS": "many"}, "SF_STEPS: Input should be a valid integer"),
        # a shared value's old per-service name names its one variable
        ("trainer", {"SF_TRAINER_STEPS": "3"}, "the run's steps is SF_STEPS"),
        ("agents", {"SF_AGENTS_MAX_TOKENS": "9"}, "the run's max_tokens is SF_MAX_TOKENS"),
        ("trajectory", {"SF_TRAJECTORY_TOTAL_BATCHES": "5"}, "TOTAL_BATCHES is no longer read"),
        ("trainer", {"SF_TRAINER_SEED": "1"}, "the run's seed is SF_SEED"),
    ],
)
def test_a_service_with_invalid_settings_exits_with_one_line(
    service: str, settings: dict[str, str], expected: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", service],
        env=clean_env(**settings),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"{service}: invalid settings") and expected in line


def test_an_otlp_protocol_the_exporter_does_not_speak_stops_a_service_with_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sf_app", "serve", "tag-scheduler"],
        env=clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_EXPORTER_OTLP_PROTOCOL="grpc"
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == EXIT_UNRECOVERABLE, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("tag-scheduler: OTEL_EXPORTER_OTLP_PROTOCOL=grpc: spans are sent")


async def weight_sync_answers(url: str, run_id: str) -> None:
    """Until weight-sync answers a current-version query (it is connected and serving)."""
    from seamlessflow.protocol import CurrentVersion, CurrentVersionQuery

    bus = await connect(url, Subjects(run_id), name="probe")
    try:
        async with asyncio.timeout(60):
            while True:
                try:
                    query = CurrentVersionQuery(engine_id="probe")
                    await bus.request(
                        bus.subjects.weights_current(), query, CurrentVersion, timeout=1.0
                    )
                    return
                except Exception:  # no responder yet
                    await asyncio.sleep(0.2)
    finally:
        await bus.drain()


def test_a_service_stopped_after_nats_went_away_exits_cleanly_with_one_line(
    tmp_path: Path,
) -> None:
    """compose: ``down`` without the profile of one service leaves it running; stopped
    later, with NATS gone, it printed a traceback and exited 1 (closing the connection
    wrote to a dead transport). It must stop as asked: exit 0, one line saying why
    nothing was drained."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    env = clean_env(SF_NATS_URL=server.url, SF_RUN_ID="gone")
    process = subprocess.Popen(
        [sys.executable, "-m", "sf_app", "serve", "weight-sync"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        asyncio.run(weight_sync_answers(server.url, "gone"))
    finally:
        server.stop()
    time.sleep(1.0)  # it is reconnecting now
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "NATS is unreachable: stopping without a drain" in stderr
