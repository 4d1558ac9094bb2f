"""The one service skeleton: config -> connect -> TaskGroup of loops -> SIGTERM -> drain.

A service is an object with ``name`` and ``async run(ctx)``. ``run`` starts its loops
with :func:`supervise` and returns when they end. The skeleton owns the NATS connection,
telemetry and signals: SIGTERM/SIGINT set ``ctx.stopping``; the service then has
``drain_timeout_s`` to finish in-flight work before it is cancelled. Shutdown is
idempotent (a second signal does no harm).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

from seamlessflow import telemetry
from seamlessflow.bus import EXIT_UNRECOVERABLE, Bus, Unrecoverable, connect
from seamlessflow.protocol import Subjects
from seamlessflow.runfile import RunFileError
from seamlessflow.settings import MeshSettings

log = logging.getLogger(__name__)


@dataclass
class ServiceContext:
    mesh: MeshSettings
    bus: Bus
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def subjects(self) -> Subjects:
        return self.bus.subjects


class Service(Protocol):
    name: str

    async def run(self, ctx: ServiceContext) -> None: ...


async def supervise(stopping: asyncio.Event, *loops: Coroutine[Any, Any, None]) -> None:
    """Run ``loops`` in a TaskGroup until they all return or ``stopping`` is set.

    One loop raising cancels its siblings and the error propagates (the process fails
    loudly instead of limping on half-alive).
    """
    tasks: list[asyncio.Task[None]] = []

    async def cancel_on_stop() -> None:
        await stopping.wait()
        for task in tasks:
            task.cancel()

    watcher = asyncio.create_task(cancel_on_stop())
    try:
        async with asyncio.TaskGroup() as group:
            tasks.extend(group.create_task(loop) for loop in loops)
    finally:
        watcher.cancel()


def configure_logging(service_name: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {service_name}[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    # one line per HTTP request of every agent drowns the log; errors still show
    for chatty in ("httpx", "httpx2"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


def spans_file_name(service: str) -> str:
    """This process's file in ``<run>/spans/``: the host name as well as the pid, since
    every container of a compose stack is pid 1 on its own host (two engine replicas
    writing one file interleave their lines)."""
    host = "".join(c if c.isalnum() or c in "-_." else "_" for c in socket.gethostname())
    return f"{service}-{host or 'host'}-{os.getpid()}.jsonl"


async def run_service(service: Service, mesh: MeshSettings) -> None:
    """Run one service until it finishes or is signalled; always drain and flush spans."""
    jsonl = mesh.run_dir / "spans" / spans_file_name(service.name) if mesh.run_dir else None
    try:
        telemetry.setup(
            service.name, jsonl_path=jsonl, otlp_endpoint=mesh.otlp_endpoint, run_id=mesh.run_id
        )
    except telemetry.TelemetryConfigError as exc:  # a restart would meet the same variables
        raise Unrecoverable(str(exc)) from None
    bus = await connect(
        mesh.nats_url,
        Subjects(mesh.run_id, mesh.policy),
        name=f"{service.name}@{socket.gethostname()}",
        token=mesh.nats_token.get_secret_value(),
        wait_s=mesh.nats_connect_wait_s,
        replicas=mesh.nats_replicas,
    )
    ctx = ServiceContext(mesh=mesh, bus=bus)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, ctx.stopping.set)
    try:
        await bus.ensure_streams(mesh.policy_names())
        run_task = asyncio.create_task(service.run(ctx))
        stop_task = asyncio.create_task(ctx.stopping.wait())
        await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        stop_task.cancel()
        if ctx.stopping.is_set():
            # said even when the service's own loops saw the signal first and ended
            log.info("stopping: draining for up to %.1fs", mesh.drain_timeout_s)
        if not run_task.done():
            done, _ = await asyncio.wait({run_task}, timeout=mesh.drain_timeout_s)
            if not done:
                log.warning("drain timed out; cancelling")
                run_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run_task
        if not run_task.cancelled():
            failure = run_task.exception()
            if failure is not None and ctx.stopping.is_set() and bus.lost_to_the_server(failure):
                # Asked to stop while the server was gone: a request still in flight (a
                # consumer being set up) times out. That is the stop, not a failure.
                log.warning("stopped while NATS was unreachable: %r", failure)
            else:
                run_task.result()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        # The process is on its way out: a SIGTERM now (a supervisor's second one, which
        # the removed handler would have taken) must not kill it with the default action
        # before the connection drains and the spans are flushed (exit -15, not 0).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        await bus.drain()
        telemetry.shutdown()


def main(service: Service, mesh: MeshSettings | None = None) -> None:
    """Process entry point used by ``python -m <service>`` and ``seamlessflow serve``."""
    import uvloop

    mesh = mesh or MeshSettings()
    configure_logging(service.name, mesh.log_level)
    try:
        uvloop.run(run_service(service, mesh))
    except Exception as exc:
        unrecoverable = unrecoverable_cause(exc)
        if unrecoverable is None:
            raise
        exit_unrecoverable(service.name, unrecoverable)


def run_process(name: str, start: Callable[[], object]) -> None:
    """This process is service ``name`` (its ``python -m`` entry): ``start`` builds it
    from the environment (and the run file ``SF_CONFIG`` names) and runs it. Invalid
    settings end the process with one line naming each problem (exit code
    ``EXIT_UNRECOVERABLE``: a supervisor that restarts it would only meet the same
    error)."""
    from pydantic import ValidationError

    try:
        start()
    except ValidationError as exc:
        problems = "; ".join(
            ".".join(map(str, error["loc"])) + ": " + error["msg"] if error["loc"] else error["msg"]
            for error in exc.errors()
        )
        print(f"{name}: invalid settings ({exc.title}): {problems}", file=sys.stderr)
        raise SystemExit(EXIT_UNRECOVERABLE) from None
    except RunFileError as exc:  # a key no settings class knows, or an unreadable file
        print(f"{name}: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_UNRECOVERABLE) from None


def run_service_process(name: str, service: Callable[[], Service]) -> None:
    """``run_process`` for a process that is one service built with no arguments."""
    run_process(name, lambda: main(service()))


def unrecoverable_cause(exc: BaseException) -> Unrecoverable | None:
    """The :class:`Unrecoverable` that ended a service, also from inside the exception
    groups of its TaskGroups (a failing loop cancels its siblings: their cancellations
    are not errors)."""
    if isinstance(exc, Unrecoverable):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = unrecoverable_cause(inner)
            if found is not None:
                return found
    return None


def exit_unrecoverable(name: str, exc: Unrecoverable) -> NoReturn:
    """One line on stderr that says what failed and how to fix it, and the exit code
    that tells a supervisor a restart would fail the same way."""
    logging.shutdown()
    print(f"{name}: {exc}", file=sys.stderr, flush=True)
    sys.exit(EXIT_UNRECOVERABLE)
