"""Credentials: the embedded run's NATS server takes a token, its gateway an operator
key; no secret ends up in the run directory (logs, spans, summary, metrics) but in its
connection file, which only the owner reads."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from seamlessflow.bus import connect
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import Subjects
from tests.support import small_embedded_run


async def nats_hello(url: str, token: str | None) -> bytes:
    """What the server answers a client's CONNECT (+ PING) in the NATS wire protocol:
    ``PONG`` once admitted, ``-ERR 'Authorization Violation'`` otherwise."""
    host, port = url.removeprefix("nats://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        options = {"verbose": False, "pedantic": False, "lang": "python", "version": "test"}
        if token is not None:
            options["auth_token"] = token
        writer.write(b"CONNECT " + json.dumps(options).encode() + b"\r\nPING\r\n")
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()
        await writer.wait_closed()


def command_line(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


@pytest.mark.integration  # a nats-server of its own
async def test_a_nats_server_with_a_token_refuses_clients_without_it(tmp_path: Path) -> None:
    token = "t0ken-" + os.urandom(8).hex()
    server = EmbeddedNats(tmp_path / "store", token=token)
    url = server.start()
    try:
        assert server.process is not None
        assert token.encode() not in command_line(
            server.process.pid
        )  # `ps` shows command lines to everyone
        assert server._auth_dir is not None and not server._auth_dir.is_relative_to(tmp_path)
        assert (server._auth_dir / "auth.conf").stat().st_mode & 0o077 == 0
        for wrong in (None, "not-the-token"):
            assert b"Authorization Violation" in await nats_hello(url, wrong)
        assert b"PONG" in await nats_hello(url, token)
        bus = await connect(url, Subjects("creds"), name="test", token=token)
        await bus.ensure_streams()  # an authorised client has JetStream
        await bus.drain()
        auth_dir = server._auth_dir
    finally:
        server.stop()
    assert not auth_dir.exists()  # the token file goes with the server


@pytest.mark.slow
async def test_an_embedded_run_keeps_its_secrets_out_of_the_run_directory(
    run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    run = small_embedded_run(run_id, tmp_path, base_model_dir, steps=2)
    summary = await run.run()
    assert summary.status == "finished", summary.status
    secrets = [run.nats_token, run.gateway_key]
    assert all(len(secret) >= 24 for secret in secrets)  # made for this run
    files = [path for path in (tmp_path / run_id).rglob("*") if path.is_file()]
    assert any(path.name == "summary.json" for path in files)
    assert any(path.suffix == ".log" for path in files)
    connection = tmp_path / run_id / "connection.json"
    assert connection.stat().st_mode & 0o077 == 0  # the one file that holds them
    assert all(secret in connection.read_text() for secret in secrets)
    for path in files:
        if path == connection:
            continue
        content = path.read_bytes()
        for secret in secrets:
            assert secret.encode() not in content, f"a secret is in {path}"
        assert b"sk-sf-" not in content, f"a session key is in {path}"
