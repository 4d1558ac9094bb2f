"""CPU of the trajectory service per agent turn (one hop of the data plane).

Writes ``--sessions`` whole sessions into a run's trajectory stream, as the gateway
does (SessionOpened, ``--turns`` TurnRecorded, RewardReported, SessionFinished; groups
of ``--group-size``, the token shapes of ``just load``), then starts the trajectory
service on that run in this process and measures the CPU it spends until every event
is applied (read from JetStream, decoded, grouped; full groups built into batches
and published). The same start on an empty run is measured first and subtracted: what
is left is the per-event work, the same on the live path (the service follows the
stream with the same ordered consumer and applies each event the same way).

    .venv/bin/python loadtests/trajectory_load.py                    # 2000 sessions
    .venv/bin/python loadtests/trajectory_load.py --sessions 8000 --turns 4

Figures: docs/benchmarks.md, "Gateway load".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 40
COMPLETION_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2000, help="sessions written")
    parser.add_argument("--turns", type=int, default=2, help="turns per session")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups-per-batch", type=int, default=8)
    return parser.parse_args(argv)


async def write_sessions(bus: Any, sessions: int, turns: int, group_size: int) -> int:
    """The gateway's events for ``sessions`` sessions; returns how many were written."""
    from seamlessflow.protocol import (
        RewardReported,
        SessionFinished,
        SessionOpened,
        TurnRecorded,
    )
    from sf_trajectory.dispatch import group_id

    events = 0
    pending: list[asyncio.Future[int]] = []
    for index in range(sessions):
        session = "s" + uuid.uuid4().hex
        subject = bus.subjects.trajectory_event(session)
        group, sample = divmod(index, group_size)
        records: list[Any] = [
            SessionOpened(session_id=session, task_id=f"t{group}", group_id=group_id(group),
                          sample_index=sample, group_size=group_size, policy="policy"),
        ]  # fmt: skip
        prompt = list(range(10, 10 + PROMPT_TOKENS))
        for turn in range(turns):
            completion = list(range(100, 100 + COMPLETION_TOKENS))
            records.append(
                TurnRecorded(
                    session_id=session,
                    turn_index=turn,
                    request_id=uuid.uuid4().hex,
                    engine_id="e",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    logprobs=[-0.5] * COMPLETION_TOKENS,
                    versions=[0] * COMPLETION_TOKENS,
                    finish_reason="length",
                    completion_text="abcd",
                    policy="policy",
                    temperature=1.0,
                    top_p=1.0,
                )
            )
            prompt = prompt + completion + [7, 8, 9]
        records += [
            RewardReported(session_id=session, reward=float(sample % 2)),
            SessionFinished(session_id=session),
        ]
        for record in records:
            pending.append(asyncio.ensure_future(bus.js_publish(subject, record)))
        if len(pending) >= 512:
            await asyncio.gather(*pending)
            pending.clear()
        events += len(records)
    await asyncio.gather(*pending)
    return events


async def measure(nats_url: str, args: argparse.Namespace, sessions: int) -> dict[str, Any]:
    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects
    from seamlessflow.service import ServiceContext
    from seamlessflow.settings import MeshSettings
    from sf_trajectory.service import TrajectoryService
    from sf_trajectory.settings import TrajectorySettings

    run_id = "tl" + uuid.uuid4().hex[:10]
    writer = await connect(nats_url, Subjects(run_id), name="writer")
    await writer.ensure_streams()
    events = await write_sessions(writer, sessions, args.turns, args.group_size)
    await writer.drain()

    service = TrajectoryService(
        TrajectorySettings(
            group_size=args.group_size, groups_per_batch=args.groups_per_batch, data_filters=""
        )
    )
    bus = await connect(nats_url, Subjects(run_id), name="trajectory")
    ctx = ServiceContext(mesh=MeshSettings(nats_url=nats_url, run_id=run_id), bus=bus)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    task = asyncio.create_task(service.run(ctx))
    async with asyncio.timeout(600):
        await service.ready.wait()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    batches = service.task_line.next_batch_index
    ctx.stopping.set()
    await task
    await bus.drain()
    return {"sessions": sessions, "events": events, "cpu_s": cpu, "wall_s": wall,
            "batches": batches}  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    from seamlessflow.natsserver import EmbeddedNats

    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp)) as server:
        empty = await measure(server.url, args, 0)
        full = await measure(server.url, args, args.sessions)
    turns = args.sessions * args.turns
    cpu = full["cpu_s"] - empty["cpu_s"]
    result = {
        "load_average": os.getloadavg(),
        "empty": empty,
        "full": full,
        "cpu_ms_per_event": 1e3 * cpu / full["events"],
        "cpu_ms_per_turn": 1e3 * cpu / turns,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(parse_args()))
