"""A run's JetStream store read back: a nats-server (or a cluster) on a run's store
folder, and the trajectory events and batch reports stored there."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

from seamlessflow.bus import Bus, connect
from seamlessflow.natsserver import EmbeddedNats, embedded_cluster
from seamlessflow.protocol import (
    BatchFilterReport,
    Subjects,
    TrajectoryEvent,
    decode,
)


async def cancel_if_running(running: asyncio.Task) -> None:  # type: ignore[type-arg]
    """A run the test stopped waiting for (a failed assertion, a time-out) ends here."""
    if not running.done():
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)


@contextlib.asynccontextmanager
async def run_store(store_dir: Path, cluster: int) -> AsyncIterator[str]:
    """A broker on a finished run's JetStream store: its one server, or its cluster's
    nodes started again from their stores (they elect leaders first); the URL."""
    servers = embedded_cluster(store_dir, cluster) if cluster > 1 else [EmbeddedNats(store_dir)]
    try:
        url = ",".join(server.start() for server in servers)
        yield url
    finally:
        for server in servers:
            server.stop()


async def stored_events_and_reports(
    bus: Bus,
) -> tuple[list[TrajectoryEvent], list[BatchFilterReport]]:
    """The run's trajectory events and its batch reports, as its streams hold them."""
    subjects = bus.subjects
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(subjects.stream_trajectory(), subjects.trajectory_events_all())
    ]
    reports = [
        decode(m.data, BatchFilterReport)
        for m in await bus.read_subject(subjects.stream_metrics(), subjects.data_batch_report())
    ]
    return events, reports


async def stored(run_dir: Path, run_id: str) -> tuple[list[TrajectoryEvent], dict[str, str]]:
    """The run's trajectory events and its dropped samples (session -> reason)."""
    async with run_store(run_dir / "nats", 1) as url:
        bus = await connect(url, Subjects(run_id), name="env-episodes-test")
        try:
            events, reports = await stored_events_and_reports(bus)
        finally:
            await bus.drain()
    dropped = {
        session: reason
        for report in reports
        for reason, ids in report.dropped_samples.items()
        for session in ids
    }
    return events, dropped
