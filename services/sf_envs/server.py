"""Serving a built-in environment: openenv-core's app under uvicorn on a socket bound
first, so that port 0 works and the bound URL is printed before anyone connects."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Callable

import uvicorn
from openenv.core.env_server import create_app
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse

from sf_envs.guess_number import (
    GuessAction,
    GuessNumberEnvironment,
    GuessObservation,
    NotPlaying,
    StepLatency,
)
from sf_envs.settings import EnvironmentName, EnvServerSettings

SHUTDOWN_GRACE_S = 5
"""How long a stopping server lets open sessions finish before closing them."""


def guess_number_app(settings: EnvServerSettings) -> Starlette:
    latency = StepLatency(settings.step_latency_ms, settings.step_latency_sigma, settings.seed)
    app = create_app(
        functools.partial(
            GuessNumberEnvironment,
            upper=settings.upper,
            max_turns=settings.max_turns,
            latency=latency,
        ),
        GuessAction,
        GuessObservation,
        env_name="guess_number",
        max_concurrent_envs=settings.max_sessions,
    )
    # HTTP /step gets a fresh environment per request (openenv-core's HTTP routes are
    # stateless), which has no game in play: the caller's mistake, not a server fault
    app.add_exception_handler(NotPlaying, not_playing_conflict)
    return app


async def not_playing_conflict(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(
        {"detail": f"{exc} (over HTTP every request is a new game: play over the WebSocket /ws)"},
        status_code=409,
    )


ENVIRONMENTS: dict[EnvironmentName, Callable[[EnvServerSettings], Starlette]] = {
    "guess_number": guess_number_app,
}
"""Environment name -> builder of its app; ``python -m sf_envs NAME`` serves one."""


class CannotListen(Exception):
    """The address is taken or not this machine's: a setting to change, not a fault."""


def listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise CannotListen(
            f"cannot listen on {host}:{port} ({exc.strerror}): choose another --port "
            f"(SF_ENV_PORT) or --host (SF_ENV_HOST)"
        ) from exc
    return sock


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(app: Starlette, sock: socket.socket) -> None:
    """Serve ``app`` on ``sock`` until SIGINT/SIGTERM (uvicorn's own handling: open
    sessions get ``SHUTDOWN_GRACE_S``, then their sockets close)."""
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        )
    )
    host, port = sock.getsockname()[:2]

    async def announce() -> None:
        # uvicorn offers no started event: poll its flag
        while not server.started:
            if serving.done():
                return
            await asyncio.sleep(0.02)
        # the one line a supervisor reads to learn the port (port 0 picks one)
        print(f"listening on {url_of(host, port)}", flush=True)

    serving = asyncio.create_task(server.serve(sockets=[sock]))
    await announce()
    await serving


def run(settings: EnvServerSettings) -> None:
    """Serve the environment ``settings.name`` as the settings say until SIGINT/SIGTERM; an address
    it cannot bind raises :class:`CannotListen` before anything is served."""
    import uvloop

    app = ENVIRONMENTS[settings.name](settings)
    sock = listen(settings.host, settings.port)
    uvloop.run(serve(app, sock))
