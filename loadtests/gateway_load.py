"""Gateway load test: requests/s and latency of the rollout gateway's data plane.

Starts its own nats-server (temp dir) and, in this one asyncio process (uvloop), the
tag-scheduler, weight-sync, engine worker(s) and the gateway (HTTP on a free loopback
port), exactly as the test suite's ``InProcessMesh`` does. Then, for each concurrency
level, ``N`` agents using the official ``openai`` SDK each loop: create a session, run
``--turns`` chat turns (each turn appends the assistant reply and a new user message),
finish the session; until ``--duration`` seconds or ``--max-requests`` chat requests.

Per level it reports chat requests/s and the p50/p99 latency the agent sees, then sends
the very same prompts (the token ids the gateway recorded, same seeds and budget)
straight to the engine over NATS at the same concurrency: the difference is what the
gateway adds (HTTP, SDK, tokenization, durable trajectory write). It also checks the
trajectory stream: every session stored exactly ``turns`` TurnRecorded events with
distinct turn indexes, one SessionOpened and one SessionFinished, and the text the
agent read is the recorded completion text. Any mismatch or request error -> exit 1.

``max_tokens`` is small on purpose: this measures the data plane, not the model.
The load generator shares the process (and event loop) with the services, so the
client's own cost (openai SDK, httpx) is part of the "gateway added" figure; spans are
not exported (no telemetry set-up), as in a run without a collector.

    .venv/bin/python loadtests/gateway_load.py --sessions 1,16,64 --turns 2 --duration 10
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway_load")

DEFAULT_OUT = Path("runs/load/gateway_load.json")


# --------------------------------------------------------------------------- arguments


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers: {text!r}") from None
    if not levels or any(level < 1 for level in levels):
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Load test of the rollout gateway (requests/s, latency, exactly-once)."
    )
    parser.add_argument(
        "--sessions", type=_levels, default=[1, 16, 64],
        help="concurrent sessions per level, comma list (default 1,16,64)",
    )  # fmt: skip
    parser.add_argument("--turns", type=int, default=2, help="chat turns per session")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument(
        "--max-requests", type=int, default=20_000, help="chat requests per level at most"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="completion budget")
    parser.add_argument("--engines", type=int, default=1, help="engine workers")
    parser.add_argument("--engine-batch-size", type=int, default=64)
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help="model directory used as is (default: the cached base model, built once)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    if args.turns < 1 or args.duration <= 0 or args.max_tokens < 1 or args.engines < 1:
        parser.error("--turns, --duration, --max-tokens and --engines must be positive")
    return args


def default_model_dir() -> Path:
    from seamlessflow.assets.base_model import ensure_base_model

    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    return ensure_base_model(cache / "models" / "base-arithmetic")


# --------------------------------------------------------------------------- the mesh


class InProcessMesh:
    """Services of one run started in this event loop, each with its own connection,
    as ``run_service`` would start them (minus signals); the pattern of tests/conftest.py."""

    def __init__(self, nats_url: str, run_id: str, model_dir: Path) -> None:
        from seamlessflow.settings import MeshSettings

        self.mesh = MeshSettings(nats_url=nats_url, run_id=run_id, model_dir=model_dir)
        self.running: list[tuple[Any, Any, asyncio.Task[None]]] = []

    async def start(self, service: Any) -> Any:
        from seamlessflow.bus import connect
        from seamlessflow.protocol import Subjects
        from seamlessflow.service import ServiceContext

        service_bus = await connect(
            self.mesh.nats_url, Subjects(self.mesh.run_id), name=service.name
        )
        await service_bus.ensure_streams()
        ctx = ServiceContext(mesh=self.mesh, bus=service_bus)
        task = asyncio.create_task(service.run(ctx), name=service.name)
        self.running.append((service, ctx, task))
        return service

    async def wait_ready(self, event: asyncio.Event, what: str, timeout: float = 180.0) -> None:
        """Wait for ``event``; a service that ends meanwhile (it crashed) fails loudly."""
        waiter = asyncio.create_task(event.wait())
        tasks = {task for _, _, task in self.running}
        try:
            done, _ = await asyncio.wait(
                {waiter, *tasks}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            waiter.cancel()
        if waiter not in done:
            for task in done & tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise RuntimeError(f"{task.get_name()} failed") from task.exception()
                raise RuntimeError(f"{task.get_name()} ended before {what} was ready")
            raise TimeoutError(f"{what} not ready within {timeout:.0f}s")

    async def stop(self) -> None:
        """Stop in reverse start order, one at a time: the gateway finishes its in-flight
        requests while the engines still serve them."""
        for service, ctx, task in reversed(self.running):
            ctx.stopping.set()
            try:
                await asyncio.wait_for(task, 20)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    raise
            except Exception:
                log.exception("%s did not stop cleanly", service.name)
            finally:
                await ctx.bus.drain()
        self.running.clear()


# --------------------------------------------------------------------------- measurement


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def latency_summary(seconds: list[float]) -> dict[str, float | None]:
    """p50/p99/mean/max in ms; None when there was no request (JSON has no NaN)."""
    ms = [s * 1000 for s in seconds]
    if not ms:
        return {"p50": None, "p99": None, "mean": None, "max": None}
    return {
        "p50": round(percentile(ms, 50), 3),
        "p99": round(percentile(ms, 99), 3),
        "mean": round(sum(ms) / len(ms), 3),
        "max": round(max(ms), 3),
    }


def difference(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


@dataclass
class AgentSession:
    session_id: str = ""
    seeds: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    finished: bool = False
    error: str = ""


@dataclass
class GatewayPhase:
    sessions: list[AgentSession] = field(default_factory=list)
    chat_latencies: list[float] = field(default_factory=list)
    create_latencies: list[float] = field(default_factory=list)
    finish_latencies: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    errors: int = 0

    @property
    def http_requests(self) -> int:
        return len(self.chat_latencies) + len(self.create_latencies) + len(self.finish_latencies)


def question(seed: int) -> tuple[str, str]:
    a, b = seed % 47 + 2, seed % 31 + 3
    return f"What is {a} + {b}?", f"And what is {a} + {b} + {seed % 7}?"


async def run_agents(
    http: Any, gateway_url: str, concurrency: int, args: argparse.Namespace, level: str
) -> GatewayPhase:
    """``concurrency`` agents with the openai SDK, each running whole sessions in a loop."""
    from openai import AsyncOpenAI

    phase = GatewayPhase()
    budget = args.max_requests
    counter = itertools.count()
    started = time.perf_counter()
    deadline = started + args.duration

    async def agent() -> None:
        nonlocal budget
        while time.perf_counter() < deadline and budget >= args.turns:
            budget -= args.turns
            number = next(counter)
            record = AgentSession()
            phase.sessions.append(record)
            try:
                t0 = time.perf_counter()
                created = await http.post(
                    f"{gateway_url}/sessions", json={"task_id": f"load-{level}-{number}"}
                )
                phase.create_latencies.append(time.perf_counter() - t0)
                if created.status_code != 201:
                    raise RuntimeError(f"POST /sessions: {created.status_code} {created.text}")
                body = created.json()
                record.session_id = body["session_id"]
                client = AsyncOpenAI(  # cheap: the httpx client is shared, never closed here
                    base_url=body["base_url"],
                    api_key=body["api_key"],  # the session's own key
                    http_client=http,
                    max_retries=0,
                    timeout=args.request_timeout,
                )
                first, follow_up = question(number)
                messages: list[dict[str, str]] = [{"role": "user", "content": first}]
                for turn in range(args.turns):
                    seed = number * 1000 + turn
                    t0 = time.perf_counter()
                    reply = await client.chat.completions.create(
                        model="policy",
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=args.max_tokens,
                        temperature=1.0,
                        seed=seed,
                    )
                    phase.chat_latencies.append(time.perf_counter() - t0)
                    content = reply.choices[0].message.content or ""
                    record.seeds.append(seed)
                    record.replies.append(content)
                    messages.append({"role": "assistant", "content": content})
                    messages.append({"role": "user", "content": follow_up})
                t0 = time.perf_counter()
                finished = await http.post(
                    f"{gateway_url}/sessions/{record.session_id}/finish",
                    headers={"authorization": f"Bearer {body['api_key']}"},
                )
                phase.finish_latencies.append(time.perf_counter() - t0)
                if finished.status_code != 200:
                    raise RuntimeError(f"finish: {finished.status_code} {finished.text}")
                record.finished = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                phase.errors += 1
                record.error = f"{type(exc).__name__}: {exc}"
                log.warning("session %s failed: %s", record.session_id or "?", record.error)
                if phase.errors > 100:
                    return  # the gateway is down: stop hammering it

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(agent())
    phase.elapsed = time.perf_counter() - started
    return phase


async def stored_events(bus: Any) -> list[Any]:
    from seamlessflow.protocol import TrajectoryEvent, decode

    s = bus.subjects
    messages = await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    return [decode(m.data, TrajectoryEvent) for m in messages]


def verify(
    events: list[Any], sessions: list[AgentSession], known: set[str], turns: int
) -> tuple[list[str], dict[str, dict[int, Any]]]:
    """Mismatches of ``sessions`` against the stream, and their turns by index."""
    from seamlessflow.protocol import SessionFinished, SessionOpened, TurnRecorded

    by_session: dict[str, list[Any]] = {}
    for event in events:
        by_session.setdefault(event.session_id, []).append(event)
    mismatches = [
        f"{sid}: stored but never created by an agent" for sid in by_session.keys() - known
    ]
    recorded: dict[str, dict[int, Any]] = {}
    for record in sessions:
        if not record.session_id:
            mismatches.append(f"a session was never created ({record.error})")
            continue
        sid = record.session_id
        stored = by_session.get(sid, [])
        opened = sum(isinstance(e, SessionOpened) for e in stored)
        finished = sum(isinstance(e, SessionFinished) for e in stored)
        turn_events = [e for e in stored if isinstance(e, TurnRecorded)]
        indexes = sorted(e.turn_index for e in turn_events)
        problems = []
        if record.error:
            problems.append(f"agent error {record.error}")
        if opened != 1:
            problems.append(f"{opened} SessionOpened")
        if len(turn_events) != turns or indexes != list(range(turns)):
            problems.append(f"{len(turn_events)} TurnRecorded with indexes {indexes}")
        if finished != 1:
            problems.append(f"{finished} SessionFinished")
        if stored and not isinstance(stored[-1], SessionFinished):
            problems.append(f"last event is {type(stored[-1]).__name__}")
        by_index = {e.turn_index: e for e in turn_events}
        for index, text in enumerate(record.replies):
            if index in by_index and by_index[index].completion_text != text:
                problems.append(f"turn {index}: the agent read a text other than the stored one")
        if problems:
            mismatches.append(f"{sid}: " + "; ".join(problems))
        recorded[sid] = by_index
    return mismatches, recorded


@dataclass
class DirectPhase:
    latencies: list[float] = field(default_factory=list)
    same_tokens: int = 0
    elapsed: float = 0.0
    errors: int = 0


async def run_direct(
    bus: Any,
    jobs: list[tuple[str, list[int], int, list[int]]],
    concurrency: int,
    stop_token_ids: list[int],
    args: argparse.Namespace,
) -> DirectPhase:
    """The recorded prompts straight to the engine queue over NATS, ``concurrency`` at a time."""
    from seamlessflow.protocol import GenerateReply, GenerateRequest

    phase = DirectPhase()
    pending = iter(jobs)
    started = time.perf_counter()
    deadline = started + args.duration

    async def worker() -> None:
        for session_id, prompt_ids, seed, expected in pending:
            if time.perf_counter() >= deadline:
                return
            request = GenerateRequest(
                request_id=uuid.uuid4().hex,
                session_id=session_id,
                prompt_ids=prompt_ids,
                max_tokens=args.max_tokens,
                temperature=1.0,
                top_p=1.0,
                stop_token_ids=stop_token_ids,
                seed=seed,
            )
            t0 = time.perf_counter()
            try:
                reply = await bus.request(
                    bus.subjects.engine_generate(),
                    request,
                    GenerateReply,
                    timeout=args.request_timeout,
                )
            except Exception as exc:
                phase.errors += 1
                log.warning("direct request failed: %s", exc)
                continue
            phase.latencies.append(time.perf_counter() - t0)
            phase.same_tokens += reply.token_ids == expected

    async with asyncio.TaskGroup() as group:
        for _ in range(concurrency):
            group.create_task(worker())
    phase.elapsed = time.perf_counter() - started
    return phase


# --------------------------------------------------------------------------- the run


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    import torch

    return {
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "openai": version("openai"),
        "httpx": version("httpx"),
        "nats_py": version("nats-py"),
        "uvloop": version("uvloop"),
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(levels: list[dict[str, Any]]) -> None:
    header = (
        f"{'sessions':>8} {'chat req/s':>10} {'http req/s':>10} {'gw p50':>8} {'gw p99':>8} "
        f"{'eng req/s':>9} {'eng p50':>8} {'eng p99':>8} {'+gw p50':>8} {'+gw p99':>8} "
        f"{'errors':>6}  stored"
    )
    print()
    print("latencies in ms; eng = the same prompts straight to the engine over NATS;")
    print("+gw = what the gateway path adds (agent-side latency minus direct engine latency)")
    print(header)
    print("-" * len(header))
    for r in levels:
        print(
            f"{r['sessions']:>8} {r['requests_per_s']:>10.1f} {r['http_requests_per_s']:>10.1f} "
            f"{fmt(r['latency_ms']['p50']):>8} {fmt(r['latency_ms']['p99']):>8} "
            f"{r['direct']['requests_per_s']:>9.1f} "
            f"{fmt(r['direct']['latency_ms']['p50']):>8} "
            f"{fmt(r['direct']['latency_ms']['p99']):>8} "
            f"{fmt(r['gateway_added_ms']['p50']):>8} {fmt(r['gateway_added_ms']['p99']):>8} "
            f"{r['errors']:>6}  {'OK' if r['verified'] else 'MISMATCH'}"
        )


async def run_levels(
    args: argparse.Namespace, nats_url: str, model_dir: Path, report: dict[str, Any]
) -> None:
    import openai

    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects
    from sf_gateway.config import EngineSettings, GatewaySettings
    from sf_gateway.engine_worker import EngineWorker
    from sf_gateway.gateway import GatewayService
    from sf_tag_scheduler.service import TagScheduler
    from sf_weight_sync.service import WeightSync

    run_id = "load" + uuid.uuid4().hex[:8]
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    bus = None
    http = openai.DefaultAsyncHttpxClient()
    try:
        t0 = time.perf_counter()
        await mesh.start(TagScheduler())
        await mesh.start(WeightSync())
        engines = [
            await mesh.start(
                EngineWorker(
                    EngineSettings(
                        engine_id=f"engine-{i}",
                        max_batch_size=args.engine_batch_size,
                        torch_threads=1,
                    )
                )
            )
            for i in range(args.engines)
        ]
        gateway = await mesh.start(GatewayService(GatewaySettings(port=0)))
        await mesh.wait_ready(gateway.ready, "the gateway")
        for engine in engines:
            await mesh.wait_ready(engine.ready, engine.engine_id)
        gateway_url = f"http://127.0.0.1:{gateway.bound_port}"
        stop_token_ids = list(gateway.gateway.tokenizer.stop_token_ids)
        print(f"mesh up in {time.perf_counter() - t0:.1f}s: gateway {gateway_url}, "
              f"{args.engines} engine(s), model {model_dir}", flush=True)  # fmt: skip
        bus = await connect(nats_url, Subjects(run_id), name="loadgen")

        known: set[str] = set()
        # warm-up (not measured): first forward passes, connection pool, JetStream consumer
        warm = argparse.Namespace(**{**vars(args), "max_requests": args.turns})  # one session
        warm_phase = await run_agents(http, gateway_url, 1, warm, "warmup")
        known.update(s.session_id for s in warm_phase.sessions if s.session_id)
        problems, _ = verify(await stored_events(bus), warm_phase.sessions, known, args.turns)
        if problems:
            raise RuntimeError(f"warm-up session not stored as expected: {problems}")

        for concurrency in args.sessions:
            print(f"level {concurrency} sessions: gateway ...", end="", flush=True)
            phase = await run_agents(http, gateway_url, concurrency, args, str(concurrency))
            known.update(s.session_id for s in phase.sessions if s.session_id)
            mismatches, recorded = verify(
                await stored_events(bus), phase.sessions, known, args.turns
            )
            jobs = [
                (s.session_id, turn.prompt_ids, s.seeds[i], turn.completion_ids)
                for s in phase.sessions
                for i, turn in sorted(recorded.get(s.session_id, {}).items())
                if i < len(s.seeds)
            ]
            print(" direct engine ...", end="", flush=True)
            direct = await run_direct(bus, jobs, concurrency, stop_token_ids, args)
            print(" done", flush=True)
            gw = latency_summary(phase.chat_latencies)
            eng = latency_summary(direct.latencies)
            result = {
                "sessions": concurrency,
                "turns": args.turns,
                "duration_s": round(phase.elapsed, 3),
                "sessions_completed": sum(s.finished for s in phase.sessions),
                "chat_requests": len(phase.chat_latencies),
                "requests_per_s": round(len(phase.chat_latencies) / phase.elapsed, 2),
                "http_requests_per_s": round(phase.http_requests / phase.elapsed, 2),
                "latency_ms": gw,
                "session_create_ms": latency_summary(phase.create_latencies),
                "session_finish_ms": latency_summary(phase.finish_latencies),
                "direct": {
                    "requests": len(direct.latencies),
                    "duration_s": round(direct.elapsed, 3),
                    "requests_per_s": round(len(direct.latencies) / direct.elapsed, 2)
                    if direct.elapsed > 0
                    else 0.0,
                    "latency_ms": eng,
                    "same_tokens_as_gateway": direct.same_tokens,
                    "errors": direct.errors,
                },
                "gateway_added_ms": {
                    "p50": difference(gw["p50"], eng["p50"]),
                    "p99": difference(gw["p99"], eng["p99"]),
                },
                "errors": phase.errors + direct.errors,
                "verified": not mismatches and phase.errors == 0,
                "mismatches": mismatches[:50],
                "mismatch_count": len(mismatches),
                "loadavg_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            }
            report["levels"].append(result)
            if mismatches:
                print(f"  stored turns: {len(mismatches)} MISMATCH(ES)")
                for line in mismatches[:20]:
                    print(f"    {line}")
            else:
                print(f"  stored turns: OK ({len(phase.sessions)} sessions x {args.turns} turns, "
                      "each stored exactly once, then finished)")  # fmt: skip
    finally:
        await http.aclose()
        if bus is not None:
            await bus.drain()
        await mesh.stop()


async def amain(
    args: argparse.Namespace, nats_url: str, model_dir: Path, report: dict[str, Any]
) -> int:
    loop = asyncio.get_running_loop()
    work = asyncio.create_task(run_levels(args, nats_url, model_dir, report))
    interrupted = False

    def on_signal() -> None:
        nonlocal interrupted
        interrupted = True
        work.cancel()  # run_levels' finally stops the services and drains

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        with contextlib.suppress(asyncio.CancelledError):
            await work
    except Exception:
        log.exception("the load test failed")
        return 1
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if interrupted:
        print("\ninterrupted: services stopped", file=sys.stderr)
        return 130
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import uvloop
    from transformers.utils import logging as hf_logging

    from seamlessflow.natsserver import EmbeddedNats

    hf_logging.disable_progress_bar()  # the engines' "Loading weights" bars
    model_dir = args.model_dir or default_model_dir()
    report: dict[str, Any] = {
        "machine": machine(),
        "settings": {
            "sessions": args.sessions,
            "turns": args.turns,
            "duration_s": args.duration,
            "max_requests": args.max_requests,
            "max_tokens": args.max_tokens,
            "engines": args.engines,
            "engine_batch_size": args.engine_batch_size,
            "model_dir": str(model_dir),
        },
        "levels": [],
    }
    code = 1
    try:
        with (
            tempfile.TemporaryDirectory(prefix="sf-load-") as tmp,
            EmbeddedNats(Path(tmp) / "nats") as server,
        ):
            code = uvloop.run(amain(args, server.url, model_dir, report))
    except KeyboardInterrupt:  # before or after the event loop ran
        code = 130
    levels = report["levels"]
    ok = code == 0 and bool(levels) and all(level["verified"] for level in levels)
    report["ok"] = ok
    report["interrupted"] = code == 130
    if levels:
        print_table(levels)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nfigures written to {args.out}")
    if code != 0:
        return code
    if not ok:
        print("FAILED: stored turns do not match what the agents did (see above)")
        return 1
    print("OK: every session's turns were stored exactly once")
    return 0


if __name__ == "__main__":
    sys.exit(main())
