"""Gateway load test: requests/s and latency of the rollout gateway's data plane.

Starts its own nats-server (temp dir) and, in this one asyncio process (uvloop), the
tag-scheduler, weight-sync, engine worker(s) and the gateway (HTTP on a free loopback
port), exactly as the test suite's ``InProcessMesh`` does: the *services process*.
The engines are ``scripted`` by default (``ScriptedEngine``: continuous batching, one
token per request per ``--engine-step-ms`` step, no model compute), so the engine is
not what limits 1000 sessions; ``--engine-backend hf`` serves the real tiny model.

The load generator runs in ``--client-processes K`` separate OS processes (default 2;
this script with ``--client``; 0 = in the services' own event loop), each with its
share of the sessions, and sends its latencies back as one JSON line over a pipe. For
each concurrency level, ``N`` agents, each with its own official ``openai`` SDK client,
loop: create a session, run ``--turns`` chat turns (each turn appends the assistant
reply and a new user message), finish the session; until ``--duration`` seconds or
``--max-requests`` chat requests (sessions under way then run to their end).

Per level it reports chat requests/s in the steady state (answers in the second half of
``--duration``, every agent mid-session; ``requests_per_s_overall`` counts the ramp-up
and the drain too) and the p50/p99 latency the agents see, then sends
the very same prompts (the token ids the gateway recorded, same seeds and budget)
straight to the engine over NATS from the same client processes at the same
concurrency: the difference is what the gateway adds (HTTP, the openai SDK against a
raw NATS request, templating and tokenization, the durable trajectory write). It also
checks the trajectory stream: every session stored exactly ``turns`` TurnRecorded
events with distinct turn indexes, one SessionOpened and one SessionFinished (last),
and the text the agent read is the recorded completion text; after the last level the
whole stream is checked again against every session of every level (a late duplicate
of an earlier level's turn would show there). Any mismatch or request error -> exit 1.

Limits that break first at 1000 sessions, raised or avoided here: open files (one
socket per session on each side, so the services process needs ~N + 100 and the
in-process mode ~2N + 100; the soft ``RLIMIT_NOFILE`` is raised towards the hard one);
one HTTP client shared by every agent (its pool scans all its connections on each
request, and openai's default keeps only 100 idle: each agent has its own client here,
as separate agent programs would, see ``agent_http_client``); and the engine
batch (``--engine-batch-size``, by default 1024 for the scripted engine so no request
queues inside it). NATS pending limits (512k messages per subscription) are far from
reached. Spans are not exported (no telemetry set-up), as in a run without a collector.

CPU seconds per level are reported for the services process, nats-server and the load
generators (``cpu_s``), and per chat request (``cpu_ms_per_chat``): on a machine with
few cores the load generator's openai SDK competes with the gateway for them, so
requests/s is a figure of the machine, and the gateway's CPU per request is the figure
that carries over. Also per level: the event-loop lag of both sides (``loop_lag_ms``),
the services process's memory and the sessions the gateway holds. The figures of this
machine and what limits them: docs/benchmarks.md, "Gateway load".

    .venv/bin/python loadtests/gateway_load.py                       # 100,500,1000
    .venv/bin/python loadtests/gateway_load.py --engine-backend hf --sessions 1,16,64 \\
        --client-processes 0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("gateway_load")

DEFAULT_OUT = Path("runs/load/gateway_load.json")
SCRIPT = Path(__file__).resolve()
SCRIPTED_BATCH_SIZE = 1024
"""Default engine batch of the scripted engine: every request of 1000 sessions decodes
at once (a fast engine), so queueing happens in the gateway, not in the engine."""


# --------------------------------------------------------------------------- arguments


def _int_list(minimum: int, what: str) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of integers, each at least ``minimum``."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma list of integers: {text!r}"
            ) from None
        if not values or any(value < minimum for value in values):
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}")
        return values

    return parse


_levels = _int_list(1, "concurrency levels")
# gateway process counts; 0 = the gateway in the services process
_process_counts = _int_list(0, "gateway process counts")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Load test of the rollout gateway (requests/s, latency, exactly-once)."
    )
    parser.add_argument(
        "--sessions", type=_levels, default=[100, 500, 1000],
        help="concurrent sessions per level, comma list (default 100,500,1000)",
    )  # fmt: skip
    parser.add_argument("--turns", type=int, default=2, help="chat turns per session")
    parser.add_argument(
        "--duration", type=float, default=30.0,
        help="seconds per level (default 30: at 1000 sessions the ramp-up takes seconds, "
        "and req/s counts the second half)",
    )  # fmt: skip
    parser.add_argument(
        "--max-requests", type=int, default=100_000, help="chat requests per level at most"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="completion budget")
    parser.add_argument(
        "--engine-backend", choices=["scripted", "hf"], default="scripted",
        help="scripted: no model compute (default); hf: the real tiny model on CPU",
    )  # fmt: skip
    parser.add_argument(
        "--engine-step-ms", type=float, default=1.0,
        help="scripted engine: milliseconds per decode step (default 1)",
    )  # fmt: skip
    parser.add_argument("--engines", type=int, default=1, help="engine workers")
    parser.add_argument(
        "--engine-batch-size", type=int, default=None,
        help=f"requests decoded together (default: {SCRIPTED_BATCH_SIZE} scripted, 64 hf)",
    )  # fmt: skip
    parser.add_argument(
        "--client-processes", type=int, default=2,
        help="OS processes running the agents (0 = in the services' event loop; default 2)",
    )  # fmt: skip
    parser.add_argument(
        "--gateway-processes", type=_process_counts, default=[0],
        help="gateway processes behind one port (SF_GATEWAY_REUSE_PORT), comma list: one "
        "run per count (default 0: the gateway in the services process)",
    )  # fmt: skip
    parser.add_argument(
        "--trajectory", action="store_true",
        help="also run the trajectory service (its own process) reading the stream meanwhile",
    )  # fmt: skip
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument(
        "--model-dir", type=Path, default=None,
        help="model directory used as is (default: the cached base model, built once)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results file")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.turns < 1 or args.duration <= 0 or args.max_tokens < 1 or args.engines < 1:
        parser.error("--turns, --duration, --max-tokens and --engines must be positive")
    if args.client_processes < 0 or args.engine_step_ms < 0:
        parser.error("--client-processes and --engine-step-ms must be >= 0")
    if args.engine_batch_size is None:
        args.engine_batch_size = SCRIPTED_BATCH_SIZE if args.engine_backend == "scripted" else 64
    return args


def default_model_dir() -> Path:
    from sf_app.base_model import ensure_base_model

    cache = Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow")).expanduser()
    return ensure_base_model(cache / "models" / "base-arithmetic")


def raise_open_files(needed: int) -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to ``needed`` (at most the hard limit); returns the
    limits now in force. A hard limit below ``needed`` is logged: raise it with
    ``ulimit -Hn`` (root) or in /etc/security/limits.conf."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < ceiling:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, hard))
        soft = ceiling
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("open files limited to %d (hard limit); %d sessions need ~%d",
                    soft, needed, needed)  # fmt: skip
    return soft, hard


def agent_http_client(ssl_context: Any) -> Any:
    """One agent's own httpx client (openai's defaults), holding its one connection.

    Each agent is its own program with its own client, as in production. One client
    shared by N agents costs O(N) per request: the pool scans its connections on each
    request and release (measured with the SDK's httpx2 against a trivial server in one
    process: 1.4 ms of CPU per request with a client per agent at 1000 agents, 5.4 ms with
    one shared pool of 1000 connections). ``ssl_context`` is built once per process: a
    client that builds its own takes ~100 ms."""
    import openai

    # the Limits class of the HTTP library this openai version is built on (httpx2 or httpx)
    limits = type(openai.DEFAULT_CONNECTION_LIMITS)(
        max_connections=1,
        max_keepalive_connections=1,
        keepalive_expiry=4.0,  # below uvicorn's 5 s: the client drops an idle one first
    )
    return openai.DefaultAsyncHttpxClient(limits=limits, verify=ssl_context)


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


def rss_mib() -> float | None:
    """Resident memory of this process now (None where /proc is missing)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


async def gateway_sessions(gateway_url: str) -> int | None:
    """Sessions the gateway holds in memory (its health endpoint reports them)."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        health = (await client.get(f"{gateway_url}/healthz")).json()
    return health.get("sessions")


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process used so far; 0 where /proc is missing."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class GatewayProcesses:
    """``count`` ``seamlessflow serve gateway`` processes on one port (SO_REUSEPORT,
    shared sessions), as a deployment runs them: the kernel spreads the agents'
    connections among them, and a session's turns may land on any of them."""

    def __init__(self, count: int, nats_url: str, run_id: str, model_dir: Path, logs: Path):
        from seamlessflow.natsserver import free_tcp_port

        self.count = count
        self.port = free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.logs = logs
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SF_")},
            "SF_NATS_URL": nats_url,
            "SF_RUN_ID": run_id,
            "SF_MODEL_DIR": str(model_dir),
            "SF_GATEWAY_HOST": "127.0.0.1",
            "SF_GATEWAY_PORT": str(self.port),
            "SF_GATEWAY_REUSE_PORT": "true",
        }
        self.processes: list[subprocess.Popen[bytes]] = []

    def spawn(self) -> None:
        command = [str(Path(sys.executable).with_name("seamlessflow")), "serve", "gateway"]
        self.logs.mkdir(parents=True, exist_ok=True)
        for index in range(self.count):
            with (self.logs / f"gateway-{index}.log").open("wb") as log_file:
                self.processes.append(
                    subprocess.Popen(command, env=self.env, stdout=log_file, stderr=log_file)
                )

    async def start(self, timeout: float = 180.0) -> None:
        """Spawn the processes and wait until each says it listens."""
        self.spawn()
        deadline = time.monotonic() + timeout
        for index, process in enumerate(self.processes):
            log_path = self.logs / f"gateway-{index}.log"
            while "gateway listening" not in log_path.read_text(errors="replace"):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"gateway process {index} did not start:\n{tail}")
                await asyncio.sleep(0.2)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    async def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                await asyncio.to_thread(process.wait, 30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class LoopLag:
    """How late this event loop runs a 50 ms sleep, sampled while measuring: the time a
    ready socket can wait before the loop gets to it."""

    TICK = 0.05

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _watch(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.TICK)
            self.samples.append(time.perf_counter() - t0 - self.TICK)

    def start(self) -> None:
        self.samples = []
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> dict[str, float | None]:
        """p50/p99/max lag in ms since ``start``."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        summary = latency_summary(self.samples)
        return {key: summary[key] for key in ("p50", "p99", "max")}


@dataclass
class AgentSession:
    session_id: str = ""
    seeds: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    finished: bool = False
    error: str = ""


@dataclass
class AgentPlan:
    """What one load generator (one process, or the services' loop) runs in a level."""

    gateway_url: str
    concurrency: int
    turns: int
    max_tokens: int
    duration: float
    max_requests: int
    first: int
    """Session numbers are ``first, first + stride, ...``: unique across processes."""
    stride: int
    level: str
    request_timeout: float


@dataclass
class GatewayPhase:
    sessions: list[AgentSession] = field(default_factory=list)
    chat_latencies: list[float] = field(default_factory=list)
    chats_in_window: int = 0
    """Chat requests answered in the second half of ``duration``: every agent is then
    mid-session, past the ramp-up (all open their first session at once) and before the
    drain (after the deadline agents only finish the sessions they have)."""
    create_latencies: list[float] = field(default_factory=list)
    finish_latencies: list[float] = field(default_factory=list)
    started: float = 0.0
    """time.monotonic() (one clock for every process of this machine)."""
    ended: float = 0.0
    cpu_s: float = 0.0
    """CPU time of the process that ran the agents, during the phase."""
    loop_lag_ms: dict[str, float | None] = field(default_factory=dict)
    """Event-loop lag of the agents' process (the worst one's, merged)."""
    errors: int = 0

    @property
    def elapsed(self) -> float:
        return self.ended - self.started

    @property
    def http_requests(self) -> int:
        return len(self.chat_latencies) + len(self.create_latencies) + len(self.finish_latencies)


def describe(exc: BaseException) -> str:
    """The error and its causes (openai's "Connection error." hides the socket's)."""
    parts: list[str] = []
    while exc is not None and len(parts) < 4:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return " <- ".join(parts)


def question(seed: int) -> tuple[str, str]:
    a, b = seed % 47 + 2, seed % 31 + 3
    return f"What is {a} + {b}?", f"And what is {a} + {b} + {seed % 7}?"


async def run_agents(plan: AgentPlan, ssl_context: Any) -> GatewayPhase:
    """``plan.concurrency`` agents with the openai SDK, each running whole sessions."""
    from openai import AsyncOpenAI

    phase = GatewayPhase()
    budget = plan.max_requests
    counter = itertools.count(plan.first, plan.stride)
    clients = [agent_http_client(ssl_context) for _ in range(plan.concurrency)]
    lag = LoopLag()
    lag.start()
    cpu0 = time.process_time()
    phase.started = time.monotonic()
    deadline = phase.started + plan.duration
    steady = phase.started + plan.duration / 2

    async def agent(http: Any) -> None:
        nonlocal budget
        while time.monotonic() < deadline and budget >= plan.turns:
            budget -= plan.turns
            number = next(counter)
            record = AgentSession()
            phase.sessions.append(record)
            try:
                t0 = time.perf_counter()
                created = await http.post(
                    f"{plan.gateway_url}/sessions", json={"task_id": f"load-{plan.level}-{number}"}
                )
                phase.create_latencies.append(time.perf_counter() - t0)
                if created.status_code != 201:
                    raise RuntimeError(f"POST /sessions: {created.status_code} {created.text}")
                body = created.json()
                record.session_id = body["session_id"]
                # the session's own key (a gateway without per-session keys ignores it)
                api_key = body.get("api_key", "load")
                client = AsyncOpenAI(  # cheap (0.2 ms): the agent's httpx client is reused
                    base_url=body["base_url"],
                    api_key=api_key,
                    http_client=http,
                    max_retries=0,
                    timeout=plan.request_timeout,
                )
                first, follow_up = question(number)
                messages: list[dict[str, str]] = [{"role": "user", "content": first}]
                for turn in range(plan.turns):
                    seed = number * 1000 + turn
                    t0 = time.perf_counter()
                    reply = await client.chat.completions.create(
                        model="policy",
                        messages=messages,  # type: ignore[arg-type]
                        max_tokens=plan.max_tokens,
                        temperature=1.0,
                        seed=seed,
                    )
                    phase.chat_latencies.append(time.perf_counter() - t0)
                    phase.chats_in_window += steady <= time.monotonic() < deadline
                    content = reply.choices[0].message.content or ""
                    record.seeds.append(seed)
                    record.replies.append(content)
                    messages.append({"role": "assistant", "content": content})
                    messages.append({"role": "user", "content": follow_up})
                t0 = time.perf_counter()
                url = f"{plan.gateway_url}/sessions/{record.session_id}/finish"
                finished = await http.post(url, headers={"authorization": f"Bearer {api_key}"})
                phase.finish_latencies.append(time.perf_counter() - t0)
                if finished.status_code != 200:
                    raise RuntimeError(f"finish: {finished.status_code} {finished.text}")
                record.finished = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                phase.errors += 1
                record.error = describe(exc)
                log.warning("session %s failed: %s", record.session_id or "?", record.error)
                if phase.errors > 100:
                    return  # the gateway is down: stop hammering it

    try:
        async with asyncio.TaskGroup() as group:
            for http in clients:
                group.create_task(agent(http))
        phase.ended = time.monotonic()
        phase.cpu_s = time.process_time() - cpu0
    finally:
        phase.loop_lag_ms = await lag.stop()
        for http in clients:
            await http.aclose()
    return phase


@dataclass
class DirectPlan:
    """The recorded prompts one load generator sends straight to the engines."""

    concurrency: int
    duration: float
    max_tokens: int
    stop_token_ids: list[int]
    request_timeout: float
    jobs: list[tuple[str, list[int], int, list[int]]]
    """(session id, prompt ids, seed, the completion ids the gateway recorded)."""


@dataclass
class DirectPhase:
    latencies: list[float] = field(default_factory=list)
    same_tokens: int = 0
    started: float = 0.0
    ended: float = 0.0
    cpu_s: float = 0.0
    errors: int = 0

    @property
    def elapsed(self) -> float:
        return self.ended - self.started


async def run_direct(bus: Any, plan: DirectPlan) -> DirectPhase:
    """The recorded prompts straight to the engine queue over NATS, ``concurrency`` at a time."""
    from seamlessflow.protocol import GenerateReply, GenerateRequest

    phase = DirectPhase()
    pending = iter(plan.jobs)
    cpu0 = time.process_time()
    phase.started = time.monotonic()
    deadline = phase.started + plan.duration

    async def worker() -> None:
        for session_id, prompt_ids, seed, expected in pending:
            if time.monotonic() >= deadline:
                return
            request = GenerateRequest(
                request_id=uuid.uuid4().hex,
                session_id=session_id,
                prompt_ids=prompt_ids,
                max_tokens=plan.max_tokens,
                temperature=1.0,
                top_p=1.0,
                stop_token_ids=plan.stop_token_ids,
                seed=seed,
            )
            t0 = time.perf_counter()
            try:
                reply = await bus.request(
                    bus.subjects.engine_generate(),
                    request,
                    GenerateReply,
                    timeout=plan.request_timeout,
                )
            except Exception as exc:
                phase.errors += 1
                log.warning("direct request failed: %s", exc)
                continue
            phase.latencies.append(time.perf_counter() - t0)
            phase.same_tokens += reply.token_ids == expected

    async with asyncio.TaskGroup() as group:
        for _ in range(plan.concurrency):
            group.create_task(worker())
    phase.ended = time.monotonic()
    phase.cpu_s = time.process_time() - cpu0
    return phase


def merge_gateway(parts: list[GatewayPhase]) -> GatewayPhase:
    merged = GatewayPhase(
        started=min(p.started for p in parts),
        ended=max(p.ended for p in parts),
        cpu_s=sum(p.cpu_s for p in parts),
        errors=sum(p.errors for p in parts),
        chats_in_window=sum(p.chats_in_window for p in parts),
        loop_lag_ms=max((p.loop_lag_ms for p in parts), key=lambda lag: lag.get("max") or 0),
    )
    for p in parts:
        merged.sessions += p.sessions
        merged.chat_latencies += p.chat_latencies
        merged.create_latencies += p.create_latencies
        merged.finish_latencies += p.finish_latencies
    return merged


def merge_direct(parts: list[DirectPhase]) -> DirectPhase:
    if not parts:
        return DirectPhase()
    merged = DirectPhase(
        started=min(p.started for p in parts),
        ended=max(p.ended for p in parts),
        cpu_s=sum(p.cpu_s for p in parts),
        errors=sum(p.errors for p in parts),
        same_tokens=sum(p.same_tokens for p in parts),
    )
    for p in parts:
        merged.latencies += p.latencies
    return merged


def shares(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as possible (the first get one more)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


# --------------------------------------------------------------------------- client processes


class ClientPool:
    """``count`` load-generator processes (this script with ``--client``), alive for the
    whole run. One JSON line per command on a client's stdin, one JSON line back on its
    stdout; its logs go to stderr (inherited). A client exits when its stdin closes."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.processes: list[asyncio.subprocess.Process] = []

    async def start(self, args: argparse.Namespace, setup: dict[str, Any]) -> None:
        command = [sys.executable, str(SCRIPT), "--client"]
        command += ["--log-level", args.log_level]
        for _ in range(self.count):
            self.processes.append(
                await asyncio.create_subprocess_exec(
                    *command,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                    limit=1 << 30,  # a level's latencies and replies come back as one line
                )
            )
        await self.call([{"cmd": "setup", **setup}] * self.count)

    async def call(self, commands: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
        """Send ``commands[i]`` to client i (None: nothing), all at once; the replies."""

        async def one(process: asyncio.subprocess.Process, command: dict[str, Any]) -> Any:
            assert process.stdin is not None and process.stdout is not None
            process.stdin.write(json.dumps(command).encode() + b"\n")
            await process.stdin.drain()
            line = await process.stdout.readline()
            if not line:
                code = await process.wait()
                raise RuntimeError(f"load-generator process {process.pid} exited with {code}")
            reply = json.loads(line)
            if "error" in reply:
                raise RuntimeError(f"load-generator process {process.pid}: {reply['error']}")
            return reply

        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(one(process, command))
                for process, command in zip(self.processes, commands, strict=True)
                if command is not None
            ]
        return [task.result() for task in tasks]

    async def close(self) -> None:
        """Close every client's stdin (it exits), then wait; kill one that hangs."""
        for process in self.processes:
            if process.stdin is not None and not process.stdin.is_closing():
                process.stdin.close()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 10)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.processes.clear()


class LoadGenerators:
    """Where the agents and the direct engine calls run: ``ClientPool`` processes, or
    the services' own event loop (``--client-processes 0``)."""

    def __init__(self, args: argparse.Namespace, nats_url: str, run_id: str) -> None:
        self.args = args
        self.nats_url = nats_url
        self.run_id = run_id
        self.pool = ClientPool(args.client_processes) if args.client_processes else None
        self.ssl_context: Any = None
        self.bus: Any = None

    @property
    def count(self) -> int:
        return self.pool.count if self.pool else 1

    async def start(self) -> None:
        if self.pool:
            per_process = -(-max(self.args.sessions) // self.pool.count)
            await self.pool.start(
                self.args,
                {"nats_url": self.nats_url, "run_id": self.run_id, "connections": per_process},
            )
        else:
            import ssl

            from seamlessflow.bus import connect
            from seamlessflow.protocol import Subjects

            self.ssl_context = ssl.create_default_context()
            self.bus = await connect(self.nats_url, Subjects(self.run_id), name="loadgen")

    async def close(self) -> None:
        if self.pool:
            await self.pool.close()
        if self.bus is not None:
            await self.bus.drain()

    async def agents(
        self, gateway_url: str, concurrency: int, max_requests: int, level: str
    ) -> GatewayPhase:
        args = self.args
        counts = shares(concurrency, self.count)
        budgets = [max_requests * c // concurrency for c in counts]
        plans = [
            AgentPlan(
                gateway_url=gateway_url,
                concurrency=c,
                turns=args.turns,
                max_tokens=args.max_tokens,
                duration=args.duration,
                max_requests=budget,
                first=i,
                stride=self.count,
                level=level,
                request_timeout=args.request_timeout,
            )
            if c
            else None
            for i, (c, budget) in enumerate(zip(counts, budgets, strict=True))
        ]
        if self.pool is None:
            assert plans[0] is not None
            return await run_agents(plans[0], self.ssl_context)
        replies = await self.pool.call(
            [None if p is None else {"cmd": "agents", **dataclasses.asdict(p)} for p in plans]
        )
        return merge_gateway([gateway_phase(r) for r in replies])

    async def direct(
        self, jobs: list[tuple[str, list[int], int, list[int]]], concurrency: int, stop: list[int]
    ) -> DirectPhase:
        args = self.args
        counts = shares(concurrency, self.count)
        active = sum(1 for c in counts if c)  # the first ``active`` generators have work
        plans = [
            DirectPlan(
                concurrency=c,
                duration=args.duration,
                max_tokens=args.max_tokens,
                stop_token_ids=stop,
                request_timeout=args.request_timeout,
                jobs=jobs[i::active],
            )
            if c
            else None
            for i, c in enumerate(counts)
        ]
        if self.pool is None:
            assert plans[0] is not None
            return await run_direct(self.bus, plans[0])
        replies = await self.pool.call(
            [None if p is None else {"cmd": "direct", **dataclasses.asdict(p)} for p in plans]
        )
        return merge_direct([DirectPhase(**r) for r in replies])


def gateway_phase(reply: dict[str, Any]) -> GatewayPhase:
    sessions = [AgentSession(**s) for s in reply.pop("sessions")]
    return GatewayPhase(sessions=sessions, **reply)


async def client_main(args: argparse.Namespace) -> int:
    """A load-generator process: commands on stdin, replies on the original stdout."""
    import ssl

    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # anything else printed goes to stderr, not into the replies
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    ssl_context = ssl.create_default_context()
    bus: Any = None
    try:
        while line := await reader.readline():
            command = json.loads(line)
            cmd = command.pop("cmd")
            reply: dict[str, Any]
            try:
                if cmd == "setup":
                    raise_open_files(command["connections"] + 100)
                    bus = await connect(
                        command["nats_url"], Subjects(command["run_id"]), name="loadgen"
                    )
                    reply = {"pid": os.getpid()}
                elif cmd == "agents":
                    phase = await run_agents(AgentPlan(**command), ssl_context)
                    reply = dataclasses.asdict(phase)
                elif cmd == "direct":
                    command["jobs"] = [tuple(job) for job in command["jobs"]]
                    reply = dataclasses.asdict(await run_direct(bus, DirectPlan(**command)))
                else:
                    reply = {"error": f"unknown command {cmd!r}"}
            except Exception as exc:
                log.exception("%s failed", cmd)
                reply = {"error": f"{cmd}: {type(exc).__name__}: {exc}"}
            out.write(json.dumps(reply) + "\n")
            out.flush()
    finally:
        if bus is not None:
            await bus.drain()
    return 0


# --------------------------------------------------------------------------- verification


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


# --------------------------------------------------------------------------- the run


def machine() -> dict[str, Any]:
    """The shared description (``seamlessflow.machine``) and what sets an HTTP load
    test's limits: memory, the client and server libraries, file and port limits."""
    from importlib.metadata import version

    import torch

    from seamlessflow.machine import machine_description

    def sysctl(name: str) -> str | None:
        try:
            return Path("/proc/sys", *name.split(".")).read_text().strip()
        except OSError:
            return None

    return machine_description() | {
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "openai": version("openai"),
        "httpx": version("httpx"),
        "uvicorn": version("uvicorn"),
        "nats_py": version("nats-py"),
        "uvloop": version("uvloop"),
        "rlimit_nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        "somaxconn": sysctl("net.core.somaxconn"),
        "ip_local_port_range": sysctl("net.ipv4.ip_local_port_range"),
    }


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def print_table(levels: list[dict[str, Any]]) -> None:
    header = (
        f"{'sessions':>8} {'chat req/s':>10} {'overall':>8} {'gw p50':>8} {'gw p99':>8} "
        f"{'eng req/s':>9} {'eng p50':>8} {'eng p99':>8} {'+gw p50':>8} {'+gw p99':>8} "
        f"{'svc cpu':>7} {'cli cpu':>7} {'errors':>6}  stored"
    )
    print()
    print("chat req/s: answers in the second half of --duration (every agent mid-session);")
    print("overall: every chat request over the whole level, ramp-up and drain included;")
    print("latencies in ms; eng = the same prompts straight to the engine over NATS;")
    print("+gw = what the gateway path adds (agent-side latency minus direct engine latency);")
    print("svc/cli cpu = CPU ms per chat request of the services process / the load generators")
    print(header)
    print("-" * len(header))
    for r in levels:
        print(
            f"{r['sessions']:>8} {r['requests_per_s']:>10.1f} {r['requests_per_s_overall']:>8.1f} "
            f"{fmt(r['latency_ms']['p50']):>8} {fmt(r['latency_ms']['p99']):>8} "
            f"{r['direct']['requests_per_s']:>9.1f} "
            f"{fmt(r['direct']['latency_ms']['p50']):>8} "
            f"{fmt(r['direct']['latency_ms']['p99']):>8} "
            f"{fmt(r['gateway_added_ms']['p50']):>8} {fmt(r['gateway_added_ms']['p99']):>8} "
            f"{r['cpu_ms_per_chat']['services']:>7.2f} {r['cpu_ms_per_chat']['clients']:>7.2f} "
            f"{r['errors']:>6}  {'OK' if r['verified'] else 'MISMATCH'}"
        )


class CpuMeter:
    """CPU seconds the services process, nats-server and the services in processes of
    their own (``others``: name -> pids) use between two readings."""

    def __init__(self, nats_pid: int | None, others: dict[str, list[int]] | None = None) -> None:
        self.nats_pid = nats_pid
        self.others = {name: pids for name, pids in (others or {}).items() if pids}
        self._start = self._read()

    def _read(self) -> dict[str, float]:
        readings = {
            "services": time.process_time(),
            "nats_server": process_cpu_s(self.nats_pid) if self.nats_pid else 0.0,
        }
        for name, pids in self.others.items():
            readings[name] = sum(process_cpu_s(pid) for pid in pids)
        return readings

    def lap(self) -> dict[str, float]:
        now = self._read()
        lap = {name: round(now[name] - self._start[name], 3) for name in now}
        self._start = now
        return lap


class TrajectoryProcess:
    """``seamlessflow serve trajectory`` in a process of its own, reading the trajectory
    stream while the agents write it (``--trajectory``): its CPU per chat, and how long
    after a level it has applied every session of it (its lag)."""

    def __init__(self, nats_url: str, run_id: str, model_dir: Path, logs: Path) -> None:
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("SF_")},
            "SF_NATS_URL": nats_url,
            "SF_RUN_ID": run_id,
            "SF_MODEL_DIR": str(model_dir),
        }
        self.logs = logs
        self.process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        command = [str(Path(sys.executable).with_name("seamlessflow")), "serve", "trajectory"]
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / "trajectory.log").open("wb") as log_file:
            self.process = subprocess.Popen(command, env=self.env, stdout=log_file, stderr=log_file)

    async def exported(self, bus: Any, session_id: str) -> Any:
        """The service's export of ``session_id`` (None: it does not know it yet)."""
        from seamlessflow.bus import NoResponder, RemoteError
        from seamlessflow.protocol import SessionExport, SessionExportQuery

        try:
            query = SessionExportQuery(session_id=session_id)
            return await bus.request(
                bus.subjects.trajectory_export(), query, SessionExport, timeout=5.0
            )
        except (RemoteError, NoResponder, TimeoutError):
            return None

    async def start(self, bus: Any, timeout: float = 180.0) -> None:
        """Spawn it and wait until it answers (an export query for no session)."""
        from seamlessflow.bus import RemoteError
        from seamlessflow.protocol import SessionExport, SessionExportQuery

        self.spawn()
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = (self.logs / "trajectory.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the trajectory service did not start:\n{tail}")
            try:
                query = SessionExportQuery(session_id="s0")
                await bus.request(
                    bus.subjects.trajectory_export(), query, SessionExport, timeout=2.0
                )
            except RemoteError:
                return  # it answers (that no such session exists)
            except Exception:  # no responder yet, or no answer in time
                await asyncio.sleep(0.5)

    async def lag_s(self, bus: Any, session_ids: list[str], timeout: float = 300.0) -> float:
        """Seconds until every one of ``session_ids`` is exported as finished."""
        started = time.perf_counter()
        for session_id in session_ids:
            while True:
                export = await self.exported(bus, session_id)
                if export is not None and export.finished:
                    break
                if time.perf_counter() - started > timeout:
                    raise RuntimeError(f"the trajectory service never applied {session_id}")
                await asyncio.sleep(0.05)
        return round(time.perf_counter() - started, 3)

    @property
    def pids(self) -> list[int]:
        return [self.process.pid] if self.process is not None else []

    async def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
        try:
            await asyncio.to_thread(self.process.wait, 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


async def run_levels(
    args: argparse.Namespace,
    nats_url: str,
    nats_pid: int | None,
    model_dir: Path,
    report: dict[str, Any],
    gateway_processes: int = 0,
) -> None:
    from seamlessflow.bus import connect
    from seamlessflow.protocol import Subjects
    from sf_engine.service import EngineService
    from sf_engine.settings import EngineSettings
    from sf_gateway.service import GatewayService
    from sf_gateway.settings import GatewaySettings
    from sf_tag_scheduler.service import TagSchedulerService
    from sf_weight_sync.service import WeightSyncService

    run_id = "load" + uuid.uuid4().hex[:8]
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    if args.engine_backend == "scripted":
        os.environ["SF_ENGINE_SCRIPTED_STEP_S"] = str(args.engine_step_ms / 1000)
    generators = LoadGenerators(args, nats_url, run_id)
    bus = None
    gateways: GatewayProcesses | None = None
    trajectory: TrajectoryProcess | None = None
    try:
        t0 = time.perf_counter()
        await mesh.start(TagSchedulerService())
        await mesh.start(WeightSyncService())
        engines = [
            await mesh.start(
                EngineService(
                    EngineSettings(
                        engine_id=f"engine-{i}",
                        backend=args.engine_backend,
                        max_batch_size=args.engine_batch_size,
                        torch_threads=1,
                    )
                )
            )
            for i in range(args.engines)
        ]
        if gateway_processes:
            logs = args.out.parent / f"gateway-logs-{run_id}"
            gateways = GatewayProcesses(gateway_processes, nats_url, run_id, model_dir, logs)
            await gateways.start()
            gateway_url = gateways.url
            from sf_gateway.templating import ChatTokenizer

            stop_token_ids = list(ChatTokenizer(model_dir).stop_token_ids)
        else:
            gateway = await mesh.start(GatewayService(GatewaySettings(port=0)))
            await mesh.wait_ready(gateway.ready, "the gateway")
            gateway_url = f"http://127.0.0.1:{gateway.bound_port}"
            stop_token_ids = list(gateway.gateway.tokenizer.stop_token_ids)
        for engine in engines:
            await mesh.wait_ready(engine.ready, engine.engine_id)
        bus = await connect(nats_url, Subjects(run_id), name="loadgen-verify")
        if args.trajectory:
            logs = args.out.parent / f"trajectory-logs-{run_id}"
            trajectory = TrajectoryProcess(nats_url, run_id, model_dir, logs)
            await trajectory.start(bus)
        await generators.start()
        where = (f"{args.client_processes} client process(es)" if args.client_processes
                 else "the services' event loop")  # fmt: skip
        where_gateway = (f"{gateway_processes} gateway process(es) on" if gateway_processes
                         else "gateway")  # fmt: skip
        print(f"mesh up in {time.perf_counter() - t0:.1f}s: {where_gateway} {gateway_url}, "
              f"{args.engines} {args.engine_backend} engine(s), agents in {where}, "
              f"model {model_dir}", flush=True)  # fmt: skip

        known: set[str] = set()
        every_session: list[AgentSession] = []
        # warm-up (not measured): one session per load generator, engine, JetStream
        warm = await generators.agents(
            gateway_url, generators.count, generators.count * args.turns, "warmup"
        )
        known.update(s.session_id for s in warm.sessions if s.session_id)
        every_session += warm.sessions
        problems, _ = verify(await stored_events(bus), warm.sessions, known, args.turns)
        if problems or warm.errors:
            raise RuntimeError(f"warm-up sessions not stored as expected: {problems}")

        for concurrency in args.sessions:
            print(f"level {concurrency} sessions: gateway ...", end="", flush=True)
            others = {
                "gateways": gateways.pids if gateways else [],
                "trajectory": trajectory.pids if trajectory else [],
            }
            cpu = CpuMeter(nats_pid, others)
            lag = LoopLag()
            lag.start()
            phase = await generators.agents(
                gateway_url, concurrency, args.max_requests, str(concurrency)
            )
            services_lag = await lag.stop()
            cpu_gateway = {**cpu.lap(), "clients": round(phase.cpu_s, 3)}
            trajectory_lag_s = None
            if trajectory is not None:  # how far behind the agents it was at the end
                finished = [s.session_id for s in phase.sessions if s.finished and s.session_id]
                trajectory_lag_s = await trajectory.lag_s(bus, finished[-5:])
            known.update(s.session_id for s in phase.sessions if s.session_id)
            every_session += phase.sessions
            print(" verify ...", end="", flush=True)
            t_verify = time.perf_counter()
            events = await stored_events(bus)
            mismatches, recorded = verify(events, phase.sessions, known, args.turns)
            t_verify = time.perf_counter() - t_verify
            jobs = [
                (s.session_id, turn.prompt_ids, s.seeds[i], turn.completion_ids)
                for s in phase.sessions
                for i, turn in sorted(recorded.get(s.session_id, {}).items())
                if i < len(s.seeds)
            ]
            print(" direct engine ...", end="", flush=True)
            cpu.lap()
            direct = await generators.direct(jobs, concurrency, stop_token_ids)
            cpu_direct = {**cpu.lap(), "clients": round(direct.cpu_s, 3)}
            print(" done", flush=True)
            gw = latency_summary(phase.chat_latencies)
            eng = latency_summary(direct.latencies)
            result = {
                "gateway_processes": gateway_processes,
                "sessions": concurrency,
                "turns": args.turns,
                "duration_s": round(phase.elapsed, 3),
                "sessions_completed": sum(s.finished for s in phase.sessions),
                "chat_requests": len(phase.chat_latencies),
                # steady state: the second half of --duration, every agent mid-session
                "requests_per_s": round(phase.chats_in_window / (args.duration / 2), 2),
                "requests_per_s_overall": round(len(phase.chat_latencies) / phase.elapsed, 2),
                "http_requests_per_s": round(phase.http_requests / phase.elapsed, 2),
                "latency_ms": gw,
                "session_create_ms": latency_summary(phase.create_latencies),
                "session_finish_ms": latency_summary(phase.finish_latencies),
                "cpu_s": cpu_gateway,
                # --trajectory: seconds after the level until its last sessions were applied
                "trajectory_lag_s": trajectory_lag_s,
                "loop_lag_ms": {"services": services_lag, "clients": phase.loop_lag_ms},
                "cpu_ms_per_chat": {
                    name: round(1000 * seconds / max(1, len(phase.chat_latencies)), 3)
                    for name, seconds in cpu_gateway.items()
                },
                "direct": {
                    "requests": len(direct.latencies),
                    "duration_s": round(direct.elapsed, 3),
                    "requests_per_s": round(len(direct.latencies) / direct.elapsed, 2)
                    if direct.elapsed > 0
                    else 0.0,
                    "latency_ms": eng,
                    "same_tokens_as_gateway": direct.same_tokens,
                    "cpu_s": cpu_direct,
                    "errors": direct.errors,
                },
                "gateway_added_ms": {
                    "p50": difference(gw["p50"], eng["p50"]),
                    "p99": difference(gw["p99"], eng["p99"]),
                },
                "errors": phase.errors + direct.errors,
                "stream_events": len(events),
                "verify_s": round(t_verify, 3),
                "verified": not mismatches and phase.errors == 0,
                "mismatches": mismatches[:50],
                "mismatch_count": len(mismatches),
                "loadavg_after": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
                "services_rss_mib": rss_mib(),
                "gateway_sessions_held": await gateway_sessions(gateway_url),
            }
            report["levels"].append(result)
            if mismatches:
                print(f"  stored turns: {len(mismatches)} MISMATCH(ES)")
                for line in mismatches[:20]:
                    print(f"    {line}")
            else:
                print(f"  stored turns: OK ({len(phase.sessions)} sessions x {args.turns} turns, "
                      "each stored exactly once, then finished)")  # fmt: skip

        # Every session of every level against the whole stream, once more at the end.
        events = await stored_events(bus)
        mismatches, _ = verify(events, every_session, known, args.turns)
        report["final_check"] = {
            "sessions": len(every_session),
            "stream_events": len(events),
            "verified": not mismatches,
            "mismatch_count": len(mismatches),
            "mismatches": mismatches[:50],
        }
        print(f"final check: {len(every_session)} sessions of every level against "
              f"{len(events)} stored events: {'OK' if not mismatches else 'MISMATCH'}")  # fmt: skip
    finally:
        await generators.close()
        if bus is not None:
            await bus.drain()
        if gateways is not None:
            await gateways.stop()
        if trajectory is not None:
            await trajectory.stop()
        await mesh.stop()


async def amain(
    args: argparse.Namespace,
    nats_url: str,
    nats_pid: int | None,
    model_dir: Path,
    report: dict[str, Any],
    gateway_processes: int = 0,
) -> int:
    loop = asyncio.get_running_loop()
    work = asyncio.create_task(
        run_levels(args, nats_url, nats_pid, model_dir, report, gateway_processes)
    )
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

    if args.client:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us (stdin closes)
        return uvloop.run(client_main(args))

    from transformers.utils import logging as hf_logging

    from seamlessflow.natsserver import EmbeddedNats

    hf_logging.disable_progress_bar()  # the engines' "Loading weights" bars
    model_dir = args.model_dir or default_model_dir()
    # the gateway's sockets (one per session), plus the clients' in the same process
    sockets = max(args.sessions) * (1 if args.client_processes else 2)
    raise_open_files(sockets + 256)
    settings = {
        "sessions": args.sessions,
        "turns": args.turns,
        "duration_s": args.duration,
        "max_requests": args.max_requests,
        "max_tokens": args.max_tokens,
        "engine_backend": args.engine_backend,
        "engine_step_ms": args.engine_step_ms if args.engine_backend == "scripted" else None,
        "engines": args.engines,
        "engine_batch_size": args.engine_batch_size,
        "client_processes": args.client_processes,
        "trajectory": args.trajectory,
        "model_dir": str(model_dir),
    }
    runs: list[dict[str, Any]] = []
    code = 0
    for count in args.gateway_processes:
        if len(args.gateway_processes) > 1:
            print(f"\n=== {count or 'in-process'} gateway process(es) ===", flush=True)
        report: dict[str, Any] = {
            "machine": machine(),
            "settings": {**settings, "gateway_processes": count},
            "levels": [],
        }
        runs.append(report)
        try:
            with (
                tempfile.TemporaryDirectory(prefix="sf-load-") as tmp,
                EmbeddedNats(Path(tmp) / "nats") as server,
            ):
                nats_pid = server.process.pid if server.process else None
                code = uvloop.run(amain(args, server.url, nats_pid, model_dir, report, count))
        except KeyboardInterrupt:  # before or after the event loop ran
            code = 130
        levels = report["levels"]
        report["ok"] = (
            code == 0
            and bool(levels)
            and all(level["verified"] for level in levels)
            and report.get("final_check", {}).get("verified", False)
        )
        report["interrupted"] = code == 130
        if levels:
            print_table(levels)
        if code != 0:
            break
    ok = code == 0 and all(run["ok"] for run in runs)
    if len(runs) > 1:
        print_scaling(runs)
    out: dict[str, Any] = runs[0] if len(runs) == 1 else {"ok": ok, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nfigures written to {args.out}")
    if code != 0:
        return code
    if not ok:
        print("FAILED: stored turns do not match what the agents did (see above)")
        return 1
    print("OK: every session's turns were stored exactly once")
    return 0


def print_scaling(runs: list[dict[str, Any]]) -> None:
    """Chat turns/s and the CPU per turn of the gateways (and of the trajectory service,
    with ``--trajectory``), per gateway process count and level."""
    print(
        "\ngateway processes | sessions | chat req/s | gateway CPU ms/chat | services ms/chat"
        " | trajectory ms/chat | trajectory lag s"
    )
    for run in runs:
        count = run["settings"]["gateway_processes"]
        for level in run["levels"]:
            per_chat = level["cpu_ms_per_chat"]
            gateway_ms = per_chat.get("gateways", per_chat["services"])
            trajectory_ms = per_chat.get("trajectory", "-")
            lag = level.get("trajectory_lag_s")
            print(f"{count or 'in-process':>17} | {level['sessions']:>8} | "
                  f"{level['requests_per_s']:>10} | {gateway_ms:>19} | "
                  f"{per_chat['services']:>16} | {trajectory_ms:>18} | "
                  f"{'-' if lag is None else lag:>16}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
