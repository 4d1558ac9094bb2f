"""CPU of one ``Bus.js_publish`` of a TurnRecorded the size of ``just load``'s, with
``--concurrency`` publishers at once, on a real nats-server (a fresh run's trajectory
stream). Each publish awaits its ack, as the gateway's do.

    .venv/bin/python loadtests/js_publish_cost.py --concurrency 100
    .venv/bin/python loadtests/js_publish_cost.py --concurrency 1 --publishes 5000
    .venv/bin/python loadtests/js_publish_cost.py --msg-id     # with a message id each

Figures: docs/benchmarks.md, "Gateway load".
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path


async def main(args: argparse.Namespace) -> None:
    from seamlessflow.bus import connect
    from seamlessflow.natsserver import EmbeddedNats
    from seamlessflow.protocol import Subjects, TurnRecorded

    turn = TurnRecorded(
        session_id="s" + "0" * 32, turn_index=0, request_id="r" * 32, engine_id="e",
        prompt_ids=list(range(60)), completion_ids=[1, 2, 3, 4], logprobs=[-0.1] * 4,
        versions=[0] * 4, finish_reason="length", completion_text="abcd", policy="policy",
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp)) as server:
        bus = await connect(server.url, Subjects("b" + uuid.uuid4().hex[:8]), name="bench")
        await bus.ensure_streams()
        left = args.publishes

        async def publisher(index: int) -> None:
            nonlocal left
            subject = bus.subjects.trajectory_event(f"s{index}")
            while left > 0:
                left -= 1
                msg_id = f"s{index}.{left}" if args.msg_id else ""
                await bus.js_publish(subject, turn, msg_id=msg_id)

        for _ in range(200):  # warm-up
            await bus.js_publish(bus.subjects.trajectory_event("warm"), turn)
        cpu, wall = time.process_time(), time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for index in range(args.concurrency):
                group.create_task(publisher(index))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await bus.drain()
    print(
        f"{args.publishes} publishes, {args.concurrency} at once"
        f"{', with message ids' if args.msg_id else ''}: "
        f"{1e6 * cpu / args.publishes:.0f} us of CPU each, {args.publishes / wall:.0f}/s"
    )


if __name__ == "__main__":
    import uvloop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--publishes", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=100)
    parser.add_argument("--msg-id", action="store_true", help="a message id per publish")
    uvloop.run(main(parser.parse_args()))
