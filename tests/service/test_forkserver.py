"""The fork server (``sf_app.run.forkserver``): a process forked from it behaves as the
same service started fresh (``python -m sf_app serve <name>``, as the supervisor starts
it otherwise), seen from outside: its settings from the environment, its output in its
log, its own session, its exit code (clean, failed, signalled).

The service under test is the built-in environment server (``serve env``): a real
process that listens on the port its settings name and exits 78 with one line when it
cannot (tests/service/test_openenv_server.py).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from sf_app.run.embedded import PROCESS_DEFAULTS
from sf_app.run.forkserver import ForkServer, ForkServerGone
from sf_app.run.supervisor import ServiceProcess, free_port
from tests.support import eventually

pytestmark = pytest.mark.integration

READY_S = 120.0


def base_env() -> dict[str, str]:
    return {**os.environ, **PROCESS_DEFAULTS}


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    server = ForkServer.launch(base_env())
    problem = server.wait_ready(READY_S)
    assert problem is None, problem
    yield server
    server.close()


def start(how: str, server: ForkServer, env: dict[str, str], log: Path) -> ServiceProcess:
    """The env service, forked or fresh (exactly as the supervisor starts either)."""
    if how == "forked":
        log.touch()
        return server.start("env", env, log)
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sf_app", "serve", "env"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def env_service(port: int, **extra: str) -> dict[str, str]:
    return {
        **base_env(),
        "SF_ENV_NAME": "guess_number",
        "SF_ENV_HOST": "127.0.0.1",
        "SF_ENV_PORT": str(port),
        **extra,
    }


def health(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return int(reply.status)
    except OSError:
        return None


def test_the_server_imports_the_services_once_and_serves_only_its_environment(
    server: ForkServer,
) -> None:
    assert {"torch", "transformers", "sf_trainer.service", "sf_gateway.service"} <= set(
        server.loaded
    )
    assert server.serves(env_service(1))  # SF_ settings are read after the fork
    other = {**base_env(), "OMP_NUM_THREADS": "2"}  # read by OpenMP when torch loads
    assert not server.serves(other)
    with pytest.raises(ValueError, match="another environment"):
        server.start("env", other, Path(os.devnull))


@pytest.mark.parametrize("how", ["fresh", "forked"])
async def test_a_service_serves_from_its_settings_in_its_own_session_and_shuts_down_on_sigterm(
    how: str, server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # not where the server started: the child runs here
    port = free_port()
    log = tmp_path / "env.log"
    process = start(how, server, env_service(port), log)
    try:
        # the announcement comes after uvicorn has started (its flag is polled), so the
        # server may answer first: wait for both
        await eventually(
            lambda: (
                ("listening on" in log.read_text() and health(port) == 200)
                or process.poll() is not None
            ),
            60,
            "listening",
        )
        assert process.poll() is None, log.read_text()
        assert os.getsid(process.pid) == process.pid  # Ctrl-C at the runner misses it
        assert os.readlink(f"/proc/{process.pid}/cwd") == str(tmp_path)
        with pytest.raises(subprocess.TimeoutExpired):
            process.wait(0.2)
        process.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then ends by the signal it caught, as a shell expects
        assert process.wait(30) == -signal.SIGTERM, log.read_text()
    finally:
        process.kill()
        process.wait(30)  # reaped: a Popen collected unreaped warns in a later test
    assert process.poll() == -signal.SIGTERM
    assert health(port) is None


@pytest.mark.parametrize("how", ["fresh", "forked"])
def test_a_setting_it_cannot_use_is_one_line_and_exit_78(
    how: str, server: ForkServer, tmp_path: Path
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        log = tmp_path / "env.log"
        process = start(how, server, env_service(port), log)
        assert process.wait(60) == 78  # EX_CONFIG: the supervisor does not restart it
    [line] = log.read_text().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.parametrize("how", ["fresh", "forked"])
async def test_a_killed_service_reports_the_signal(
    how: str, server: ForkServer, tmp_path: Path
) -> None:
    port = free_port()
    process = start(how, server, env_service(port), tmp_path / "env.log")
    await eventually(lambda: health(port) == 200, 60, "listening")
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL
    process.kill()  # reaped: no signal goes to a pid that may be another process's now


async def test_children_outlive_a_server_that_is_gone_and_then_report_a_failure(
    tmp_path: Path,
) -> None:
    server = ForkServer.launch(base_env())
    assert server.wait_ready(READY_S) is None
    port = free_port()
    process = server.start("env", env_service(port), tmp_path / "env.log")
    try:
        await eventually(lambda: health(port) == 200, 60, "listening")
        server.process.kill()
        with pytest.raises(ForkServerGone):
            server.start("env", env_service(free_port()), tmp_path / "other.log")
        assert server.gone
        assert process.poll() is None
        assert health(port) == 200  # the run's process goes on without its server
    finally:
        os.kill(process.pid, signal.SIGKILL)
    # its code went with the server: an end the supervisor treats as a failure
    assert process.wait(30) == 1
    server.close()
