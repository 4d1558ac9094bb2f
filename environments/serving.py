"""What every third-party environment server under ``environments/`` shares: its
listening socket, uvicorn, and the one ``listening on http://HOST:PORT`` line that
supervisors and tests read. Imported by each ``environments/NAME/server.py`` from its
own virtual environment, so it needs nothing but uvicorn."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn

EXIT_CONFIG = 78
"""The exit code of a server that cannot start as asked (sysexits' EX_CONFIG)."""


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
