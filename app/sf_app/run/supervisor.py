"""Supervision of an embedded run's processes: start, restart within a budget, stop in order.

Every process runs exactly what it would run deployed alone (``seamlessflow serve
<service>`` with its settings in the environment), in its own session so that Ctrl-C
reaches the runner, which stops them in dependency order. It is forked from a warm
interpreter (``forkserver``: its imports done once, not per process) when the run has
one that serves its environment, and started as ``python -m sf_app serve <service>``
otherwise (a vLLM engine always: vLLM starts processes of its own). One that
ends unexpectedly is started again with the same command and environment, at most
``max_restarts`` times; an exit with ``EXIT_UNRECOVERABLE`` is never retried (it would
fail the same way) and fails the run with the process's last log line.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from seamlessflow.bus import EXIT_UNRECOVERABLE
from seamlessflow.natsserver import EmbeddedNats
from sf_app.run.forkserver import READY_TIMEOUT_S, ForkServer, ForkServerGone
from sf_app.run.memory import ProcessMemory
from sf_app.service_table import SERVICE_TABLE

log = logging.getLogger(__name__)

FINISH_GRACE_S = 30.0
"""How long a trainer that exited 0 has for its TrainingFinished to reach the run."""

STOP_TIMEOUT_S = 30.0
"""How long each stop stage has to drain before what is left is killed."""


@dataclass
class Launch:
    """How one process of the run is started (and started again by supervision)."""

    service: str
    env: dict[str, str]
    slots: list[str]


class ServiceProcess(Protocol):
    """A process of the run, fresh (``subprocess.Popen``) or forked (``ForkedProcess``)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


_fork_servers: list[ForkServer] = []
"""The fork servers of this Python process, most recent last: the runs of one process (a
benchmark's modes, a test session's worker) share them, so each imports once."""

MAX_FORK_SERVERS = 2
"""Servers kept for different environments (each holds ~0.5 GB of imports)."""


def fork_server_for(env: dict[str, str]) -> ForkServer:
    """A running server for ``env``'s import settings: this process's, or a new one
    (importing in the background; ``wait_ready`` before use)."""
    for server in _fork_servers:
        if server.serves(env):
            return server
    for server in [s for s in _fork_servers if s.gone]:
        _fork_servers.remove(server)
    while len(_fork_servers) >= MAX_FORK_SERVERS:
        _fork_servers.pop(0).close()
    server = ForkServer.launch(env)
    _fork_servers.append(server)
    return server


@atexit.register
def _close_fork_servers() -> None:
    for server in _fork_servers:
        server.close()


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Supervisor:
    """The run's processes by label (a service name, prefixed by its policy when the run
    trains several), and the embedded NATS server if the run started one."""

    def __init__(
        self,
        run_dir: Path,
        *,
        policies: list[str],
        max_restarts: int,
        pin_slots: bool,
        fork_server: bool = True,
    ) -> None:
        self.run_dir = run_dir
        self.policies = policies
        self.max_restarts = max_restarts
        self.pin_slots = pin_slots
        # the server counts its threads in /proc before it forks: Linux only
        self.use_fork_server = fork_server and sys.platform == "linux"
        self.fork_server: ForkServer | None = None
        """Where this run's processes are forked from, once ready (``prepare_fork_server``)."""
        self.processes: dict[str, ServiceProcess] = {}
        self.launches: dict[str, Launch] = {}
        """Label -> how its process was started: a restart starts it the same way."""
        self.restarts: dict[str, int] = {}
        self.nats_servers: list[EmbeddedNats] = []
        """The embedded server, or the nodes of the embedded cluster (none when the run
        uses another broker)."""
        self.process_policy: dict[str, str] = {}
        """Label of a per-policy process -> its policy."""
        self.finished_policies: set[str] = set()
        """Policies whose trainer announced its finish: its exit 0 is then a normal end."""
        self._clean_exits: dict[str, float] = {}
        """Trainers that exited 0 before their finish arrived: since when."""
        self.memory = ProcessMemory()
        """Every process's resident memory, sampled by ``unexpected_exit``'s polls."""

    @property
    def multi_policy(self) -> bool:
        return len(self.policies) > 1

    def label(self, policy: str, name: str) -> str:
        """A process's (or engine's, or slot's) name: prefixed by its policy when the
        run has several, so that every one is unique in the run."""
        return f"{policy}-{name}" if self.multi_policy else name

    def spawn(
        self, label: str, service: str, env: dict[str, str], slots: list[str] | None = None
    ) -> None:
        self.launches[label] = Launch(service, env, slots or ["slot-0"])
        self._start(label)

    async def prepare_fork_server(self, env: dict[str, str]) -> None:
        """Have a fork server for ``env`` ready (started now, or earlier by another run
        of this process). One that refuses or takes too long is logged and not used: the
        processes then start fresh, as they would without one."""
        if not self.use_fork_server:
            return
        server = fork_server_for(env)
        problem = await asyncio.to_thread(server.wait_ready, READY_TIMEOUT_S)
        if problem:
            log.warning("processes start fresh: the fork server %s", problem)
            return
        self.fork_server = server

    def _start(self, label: str) -> None:
        launch = self.launches[label]
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_file = logs / f"{label}.log"
        log_file.touch()  # there from the start, as a fresh process's redirected output
        server = self.fork_server
        process: ServiceProcess | None = None
        if server is not None and server.serves(launch.env) and not self.starts_own(launch):
            try:
                process = server.start(launch.service, launch.env, log_file)
            except ForkServerGone as exc:
                log.warning("processes start fresh from now on: %s", exc)
                self.fork_server = None
        if process is None:
            with log_file.open("ab") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "sf_app", "serve", launch.service],
                    env=launch.env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # Ctrl-C reaches the runner, which stops us
                )
        self.processes[label] = process
        self.pin(process.pid, launch.slots)

    @staticmethod
    def starts_own(launch: Launch) -> bool:
        """A process that starts processes of its own from a fresh interpreter (a vLLM
        engine: its core and worker import vLLM themselves), so a fork saves it little
        and would hand vLLM a parent that is not what it expects."""
        return launch.service == "engine" and launch.env.get("SF_ENGINE_BACKEND") == "vllm"

    def pin(self, pid: int, slots: list[str]) -> None:
        """``pin_slots``: run ``pid`` on the cores of ``slots`` (``slot-<i>``)."""
        if not self.pin_slots or not hasattr(os, "sched_setaffinity"):
            return
        cores = os.cpu_count() or 1
        os.sched_setaffinity(pid, {int(slot.rsplit("-", 1)[1]) % cores for slot in slots})

    def stop_processes(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop in dependency order (``ServiceSpec.stop_stage``), each stage draining
        before the next one stops: agents, then the gateway, then engines, then the rest
        (the trainer saves its checkpoint). SIGKILL whatever misses its deadline.
        Idempotent."""

        def service_of(label: str) -> str:
            return self.launches[label].service  # engine-0, gateway-1, <policy>-trainer ...

        # the last sample: each process's high-water mark now covers its whole life
        self.memory.sample(self.live_pids(), force=True)

        stages = [
            {spec.name for spec in SERVICE_TABLE if spec.stop_stage == stage}
            for stage in sorted({spec.stop_stage for spec in SERVICE_TABLE})
        ]
        staged = set().union(*stages)
        groups = [[label for label in self.processes if service_of(label) in s] for s in stages]
        # last, whatever no stage names (a command the table does not know)
        groups.append([label for label in self.processes if service_of(label) not in staged])
        for group in groups:
            running = [(label, self.processes[label]) for label in group]
            for _, process in running:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for label, process in running:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", label)
                    process.kill()
                    process.wait()

    def unexpected_exits(self) -> list[tuple[str, int]]:
        """``(label, exit code)`` of every process that ended but should still run.
        Normal ends: the agent runner with 0 (tasks exhausted), a trainer with 0 once
        its policy finished. A trainer exits 0 right after it announces the finish,
        which may reach this run a little later (e.g. while the run's connection to a
        restarted NATS server recovers): it has ``FINISH_GRACE_S`` to arrive."""
        ended = []
        now = time.monotonic()
        for label, process in self.processes.items():
            code = process.poll()
            if code is None:
                continue
            if label == "agents" and code == 0:
                continue
            policy = self.process_policy.get(label, "")
            if label == self.label(policy, "trainer") and code == 0:
                if policy in self.finished_policies:
                    continue
                if now - self._clean_exits.setdefault(label, now) < FINISH_GRACE_S:
                    continue
            ended.append((label, code))
        return ended

    @property
    def nats_server(self) -> EmbeddedNats | None:
        """The embedded server (a cluster's first node); None with another broker."""
        return self.nats_servers[0] if self.nats_servers else None

    def nats_label(self, index: int) -> str:
        """The embedded server's label (``nats``), or a cluster node's (``nats-<i>``)."""
        return "nats" if len(self.nats_servers) == 1 else f"nats-{index}"

    def live_pids(self) -> dict[str, int]:
        """Label -> pid of each process still running (the NATS server as ``nats``, or
        ``nats-<i>`` for a cluster's nodes)."""
        pids = {label: p.pid for label, p in self.processes.items() if p.returncode is None}
        for index, nats_server in enumerate(self.nats_servers):
            if nats_server.process is not None and nats_server.process.returncode is None:
                pids[self.nats_label(index)] = nats_server.process.pid
        return pids

    def unexpected_exit(self) -> str | None:
        """Supervision, polled while the run goes on: start again what ended unexpectedly
        (the embedded NATS server in place: same port, same store), within
        ``max_restarts`` per process. Past the budget: what failed, and the run fails."""
        self.memory.sample(self.live_pids())
        budget = self.max_restarts
        for index, nats_server in enumerate(self.nats_servers):
            if nats_server.process is None:
                continue
            code = nats_server.process.poll()
            if code is not None:
                label = self.nats_label(index)
                if self.restarts.get(label, 0) >= budget:
                    return f"{label}: nats-server exited with code {code} after {budget} restarts"
                self._count_restart(label, code)
                nats_server.restart()  # a cluster node rejoins and catches up
                self.pin(nats_server.process.pid, ["slot-0"])
        for label, code in self.unexpected_exits():
            if code == EXIT_UNRECOVERABLE:  # a restart would fail the same way
                return f"{label}: {self.last_log_line(label)}"
            if self.restarts.get(label, 0) >= budget:
                return (
                    f"{label} exited with code {code} after {budget} restarts "
                    f"(see {self.run_dir}/logs/{label}.log)"
                )
            self._count_restart(label, code)
            self._clean_exits.pop(label, None)
            launch = self.launches[label]
            if launch.service == "trainer":
                # from its latest checkpoint, numbering versions after the announced ones
                launch.env = {**launch.env, "SF_TRAINER_RESUME": "latest"}
            self._start(label)
        return None

    async def logged(self, labels: list[str], line: str, timeout_s: float) -> None:
        """Until each of ``labels`` has written ``line`` to its log, one of them has ended
        (supervision handles that) or ``timeout_s`` passed: a wait for readiness that
        never fails the run by itself."""
        deadline = time.monotonic() + timeout_s
        waiting = list(labels)
        while waiting and time.monotonic() < deadline:
            log_dir = self.run_dir / "logs"
            waiting = [
                label
                for label in waiting
                if self.processes[label].poll() is None
                and line not in (log_dir / f"{label}.log").read_text(errors="replace")
            ]
            if waiting:
                await asyncio.sleep(0.2)

    def last_log_line(self, label: str) -> str:
        """The last line a process wrote (an unrecoverable failure's one line)."""
        log_file = self.run_dir / "logs" / f"{label}.log"
        lines = log_file.read_text(errors="replace").strip().splitlines()
        return lines[-1].removeprefix(f"{self.launches[label].service}: ") if lines else ""

    def _count_restart(self, label: str, code: int) -> None:
        self.restarts[label] = self.restarts.get(label, 0) + 1
        log.warning(
            "%s exited with code %d: restart %d of %d",
            label, code, self.restarts[label], self.max_restarts,
        )  # fmt: skip
