"""What the broker carries per agent turn and per training step (docs/deployment.md).

Starts its own ``nats-server`` (JetStream, monitoring on a loopback port) and an
embedded run against it (``--nats-url``: every service its own process, as deployed),
once per workload:

- ``single-turn``: the built-in arithmetic task, one chat turn per sample;
- ``multi-turn``: the ``lookup`` tool task with the ``tool_user`` agent (a tool call,
  its result, an answer: several turns per sample).

Before and after each run it reads the server's ``/varz`` (messages and bytes in and
out, every subject: requests, heartbeats, JetStream's own API and acks included) and
``/jsz`` (each stream's stored messages and bytes: the durable record and the weights'
object store), and from the trajectory stream the turns (``TurnRecorded``) and samples
(``SessionFinished``) the run made. It prints, per workload, the totals and their
ratios per agent turn and per training step, and the stored bytes per stream; ``--out``
writes them as JSON. Everything is measured in one run per workload on this machine
with the tiny built-in model: the weights' bytes per step scale with the model (see
docs/deployment.md for the extrapolation), the rest with turns and steps.

    .venv/bin/python loadtests/broker_load.py [--steps 10] [--workloads single-turn,multi-turn]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seamlessflow.bus import connect
from seamlessflow.natsserver import EmbeddedNats, free_tcp_port
from seamlessflow.protocol import SessionFinished, Subjects, TrajectoryEvent, TurnRecorded, decode
from sf_app.run.config import RunConfig
from sf_app.run.embedded import EmbeddedRun

WORKLOADS: dict[str, dict[str, Any]] = {
    "single-turn": {"task": "arithmetic", "agent": "single_turn"},
    "multi-turn": {"task": "lookup", "agent": "tool_user"},
}


def monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        result: dict[str, Any] = json.load(response)
        return result


def traffic(port: int) -> dict[str, int]:
    varz = monitor(port, "/varz")
    return {key: int(varz[key]) for key in ("in_msgs", "in_bytes", "out_msgs", "out_bytes")}


def stored(port: int) -> dict[str, dict[str, int]]:
    """Each stream's stored messages and bytes (KV and object buckets are streams too)."""
    jsz = monitor(port, "/jsz?accounts=true&streams=true")
    streams: dict[str, dict[str, int]] = {}
    for account in jsz.get("account_details") or []:
        for detail in account.get("stream_detail") or []:
            state = detail["state"]
            streams[detail["name"]] = {"messages": state["messages"], "bytes": state["bytes"]}
    return streams


async def turns_and_samples(url: str, run_id: str) -> tuple[int, int, int]:
    subjects = Subjects(run_id)
    bus = await connect(url, subjects, name="broker-load")
    try:
        messages = await bus.read_all(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
    finally:
        await bus.drain()
    events = [decode(m.data, TrajectoryEvent) for m in messages]
    recorded = [e for e in events if isinstance(e, TurnRecorded)]
    samples = sum(isinstance(e, SessionFinished) for e in events)
    tokens = sum(len(t.prompt_ids) + len(t.completion_ids) for t in recorded)
    return len(recorded), samples, tokens


def measure(workload: str, args: argparse.Namespace, runs_dir: Path) -> dict[str, Any]:
    monitoring = free_tcp_port()
    with tempfile.TemporaryDirectory(prefix="sf-broker-load-") as store:
        server = EmbeddedNats(Path(store), extra_args=["-m", str(monitoring)])
        url = server.start()
        try:
            before = traffic(monitoring)
            config = RunConfig(
                run_id=f"broker-{workload}-{time.strftime('%Y%m%d-%H%M%S')}",
                runs_dir=runs_dir,
                steps=args.steps,
                nats_url=url,
                live=False,
                checkpoint_every=0,
                **WORKLOADS[workload],
            )
            started = time.monotonic()
            summary = asyncio.run(EmbeddedRun(config).run())
            wall_s = time.monotonic() - started
            if summary.status != "finished":
                raise SystemExit(
                    f"broker-load: the {workload} run did not finish: {summary.status}"
                )
            after = traffic(monitoring)
            streams = stored(monitoring)
            turns, samples, tokens = asyncio.run(turns_and_samples(url, config.run_id))
        finally:
            server.stop()
    moved = {key: after[key] - before[key] for key in after}
    steps = summary.final_version
    per_turn = {key: round(value / turns, 1) for key, value in moved.items()} if turns else {}
    per_step = {key: round(value / steps) for key, value in moved.items()} if steps else {}
    return {
        "workload": workload,
        **WORKLOADS[workload],
        "steps": steps,
        "samples": samples,
        "turns": turns,
        "turns_per_sample": round(turns / samples, 2) if samples else 0.0,
        # prompt + completion ids each turn records (the TurnRecorded payload grows with them)
        "tokens_per_turn": round(tokens / turns, 1) if turns else 0.0,
        "weights_transport": args.weights_transport,
        "wall_s": round(wall_s, 1),
        "broker": moved,
        "per_turn": per_turn,
        "per_step": per_step,
        "stored": streams,
        "stored_bytes_total": sum(s["bytes"] for s in streams.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workloads", default="single-turn,multi-turn")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/load/broker"))
    parser.add_argument(
        "--weights-transport",
        default="object",
        help="SF_WEIGHTS_TRANSPORT of the run: object (the store every host reaches: what a "
        "deployment of several hosts uses; default) or shm (one host)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    # the embedded run picks shm on one host; a deployment's engines pull from the store
    # (the services read it from the environment they inherit; put back after)
    previous = os.environ.get("SF_WEIGHTS_TRANSPORT")
    os.environ["SF_WEIGHTS_TRANSPORT"] = args.weights_transport
    try:
        results = measure_all(args, parser)
    finally:
        if previous is None:
            os.environ.pop("SF_WEIGHTS_TRANSPORT", None)
        else:
            os.environ["SF_WEIGHTS_TRANSPORT"] = previous
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def measure_all(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[dict[str, Any]]:
    results = []
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            parser.error(f"unknown workload {workload!r}: one of {', '.join(WORKLOADS)}")
        result = measure(workload, args, args.runs_dir)
        results.append(result)
        print(
            f"{workload}: {result['steps']} steps, {result['samples']} samples, "
            f"{result['turns']} turns ({result['turns_per_sample']}/sample, "
            f"{result['tokens_per_turn']} tokens/turn) in "
            f"{result['wall_s']}s; broker in {result['broker']['in_msgs']} msgs / "
            f"{result['broker']['in_bytes'] / 1e6:.1f} MB, out {result['broker']['out_msgs']} "
            f"msgs / {result['broker']['out_bytes'] / 1e6:.1f} MB",
            flush=True,
        )
        print(f"  per turn: {result['per_turn']}", flush=True)
        print(f"  per step: {result['per_step']}", flush=True)
        for name, state in sorted(result["stored"].items(), key=lambda kv: -kv[1]["bytes"]):
            print(f"  stored {name}: {state['messages']} msgs, {state['bytes'] / 1e6:.2f} MB")
    return results


if __name__ == "__main__":
    sys.exit(main())
