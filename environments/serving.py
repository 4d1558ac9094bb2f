"""What every third-party environment server under ``environments/`` shares: its
listening socket, uvicorn, and the one ``listening on http://HOST:PORT`` line that
supervisors and tests read. Imported by each ``environments/NAME/server.py`` from its
own virtual environment, so it needs nothing but uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

EXIT_CONFIG = 78
"""The exit code of a server that cannot start as asked (sysexits' EX_CONFIG)."""


class StepLatency:
    """How long each step of an environment waits before it answers, as a slow real
    environment would (a sandbox, a simulator, a remote service): a log-normal draw with
    median ``median_ms`` and spread ``sigma``, from one seeded generator shared by every
    session of the server. ``--step-latency-ms`` and ``--step-latency-sigma`` of every
    server here; what ``loadtests/peer_env.py`` races at 0, 100 and 1000 ms."""

    def __init__(self, median_ms: float = 0.0, sigma: float = 0.5, seed: int = 0) -> None:
        if median_ms < 0 or sigma < 0:
            raise ValueError(f"step latency needs median >= 0 and sigma >= 0: {median_ms}, {sigma}")
        self.median_ms, self.sigma = median_ms, sigma
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # sessions step on threads of their own

    def draw_s(self) -> float:
        if self.median_ms == 0:
            return 0.0
        with self._lock:
            return self._rng.lognormvariate(math.log(self.median_ms / 1000), self.sigma)

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--step-latency-ms", type=non_negative, default=0.0,
            help="median wait of a step before it answers (0: none)",
        )  # fmt: skip
        parser.add_argument(
            "--step-latency-sigma", type=non_negative, default=0.5,
            help="log-normal spread of that wait (0: always the median)",
        )  # fmt: skip

    @classmethod
    def of(cls, args: argparse.Namespace) -> StepLatency:
        return cls(args.step_latency_ms, args.step_latency_sigma)


def message_text(messages: list[dict[str, Any]]) -> str:
    """The text of chat messages, joined (a content given as parts: its text parts)."""
    texts = []
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        texts.append(str(content))
    return "\n\n".join(t for t in texts if t)


def non_negative(text: str) -> float:
    """An option's number, 0 or more (argparse's one-line error otherwise)."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def serve_main(
    name: str,
    build_app: Callable[[], Any],
    host: str,
    port: int,
    on_listening: Callable[[str, int], None] | None = None,
) -> int:
    """Build the app (an error there is the environment's: one line, ``EXIT_CONFIG``),
    bind ``host:port`` (0: any free port), tell ``on_listening`` the address bound, then
    serve until stopped."""
    try:
        app = build_app()
    except Exception as exc:
        print(f"{name}: cannot build the environment: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        print(f"{name}: cannot listen on {host}:{port} ({exc.strerror})", file=sys.stderr)
        return EXIT_CONFIG
    if on_listening is not None:
        on_listening(*sock.getsockname()[:2])
    asyncio.run(serve(app, sock))
    return 0


async def serve(app: Any, sock: socket.socket) -> None:
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:  # uvicorn offers no started event
        if serving.done():
            break
        await asyncio.sleep(0.02)
    else:
        host, port = sock.getsockname()[:2]
        print(f"listening on http://{host}:{port}", flush=True)  # the line supervisors read
    await serving
