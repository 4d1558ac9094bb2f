"""Starting an embedded run's processes from one warm interpreter (``python -m
sf_app.run.forkserver``), so that torch, transformers and the services' modules are
imported once, not once per process.

A mesh process spends most of its start importing (the trainer ~10 CPU-s, the gateway
~5, an engine ~4, on an AVX2 core), and an embedded run starts seven or more of them.
The fork server imports them once, then forks one child per request: the child takes the
run's environment and log file, enters a session of its own and runs
``seamlessflow serve <name>`` as a fresh process would (``sf_app.service_table.serve``).

Invariants that make a fork equal to a fresh start:

- **Nothing but imports before the fork.** The server refuses to serve if importing
  started a thread (a fork keeps only the forking thread: a lock another thread held
  would stay locked in the child). No event loop, no logging set-up, no CUDA: every
  service does those itself, after the fork.
- **The same environment at import time.** What a library reads when it is imported
  (``OMP_NUM_THREADS`` by the OpenMP runtime, ``ATEN_CPU_CAPABILITY`` by torch) is fixed
  in the server. So a server serves only launches whose environment equals its own
  outside the ``SF_`` settings (read by the services when they start, after the fork);
  any other launch starts a fresh interpreter (``Supervisor``), as does a vLLM engine
  (vLLM starts processes of its own; its import is theirs).
- **Fresh randomness.** Python's ``random`` is reseeded in each child (a fork copies the
  generator's state: two children would draw the same numbers).

The protocol: JSON lines. Requests on the server's stdin: ``{"service", "env", "log",
"cwd"}``.
Replies on its stdout: ``{"ready": [modules]}`` once, or ``{"refused": why}`` and the
server exits; ``{"started": pid}`` per request, in order; ``{"exited": pid, "code": c}``
as each child ends (``c`` as ``Popen.returncode``: negative for a signal). The server
reaps its children; it exits when its stdin closes (the children go on: they are in
sessions of their own, like any process the run starts).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

PRELOAD = (
    "torch",
    "transformers",
    "sf_tag_scheduler.service",
    "sf_weight_sync.service",
    "sf_trajectory.service",
    "sf_trainer.service",
    "sf_gateway.service",
    "sf_engine.service",
    "sf_envs.cli",
    "sf_agents.service",
)
"""What the server imports before it forks: the modules the services' entries import
(the engine's model code and vLLM come later, in the process that needs them)."""

EXIT_POLL_S = 0.02
"""How often a wait for a child's end asks the server."""

READY_TIMEOUT_S = 120.0
"""How long a run waits for a server to import ``PRELOAD`` before it starts its
processes fresh instead."""


NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that change between the runs of one process and that no import reads:
pytest names the running test in one, so each test would otherwise get its own server."""


def import_settings_of(env: dict[str, str]) -> dict[str, str]:
    """The part of an environment that can shape an import: everything but the services'
    own ``SF_`` settings, which are read when a service starts."""
    return {
        key: value
        for key, value in env.items()
        if not key.startswith("SF_") and key not in NOT_READ_AT_IMPORT
    }


# ------------------------------------------------------------------ the server


def serve_forks() -> None:
    """The server's loop: requests on fd 0, replies on fd 1, children reaped on SIGCHLD."""
    # replies go on a private copy of stdout: whatever an import or a child prints on
    # fd 1 or 2 must never land in the protocol
    replies = os.dup(1)
    requests = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)

    def reply(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(replies, data) :]

    loaded = []
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            continue  # an extra not installed: the service that needs it says so itself
        loaded.append(name)
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1 or threading.active_count() != 1:
        reply({"refused": f"importing {', '.join(loaded)} started {threads - 1} thread(s)"})
        return

    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    reply({"ready": loaded})

    pending = b""
    while True:
        try:
            readable, _, _ = select.select([requests, wake_read], [], [])
        except InterruptedError:
            continue
        if wake_read in readable:
            os.read(wake_read, 4096)
        while True:  # reap every child that ended (one SIGCHLD may stand for several)
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})
        if requests not in readable:
            continue
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            return  # the run closed us: its processes go on without us
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                run_child(request["service"], request["env"], request["log"], request["cwd"])
            reply({"started": pid})


def run_child(service: str, env: dict[str, str], log: str, cwd: str) -> NoReturn:
    """In the forked child: become the service's process and run it. It never returns
    into the server's loop: the service's end (a return, ``SystemExit``, an exception)
    unwinds to the top of the interpreter, which exits as a fresh one would (non-daemon
    threads joined, atexit handlers such as the tracer's flush run, the same code)."""
    try:
        os.setsid()  # as start_new_session: Ctrl-C reaches the runner, not us
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the server's pipes, as close_fds does
        os.environ.clear()
        os.environ.update(env)
        # where a fresh process would run: the run's directory now, not the server's
        # when it started (``python -m`` put that first on the import path)
        if sys.path and sys.path[0] == os.getcwd():
            sys.path[0] = cwd
        os.chdir(cwd)
        random.seed()
        sys.argv = [sys.executable]
        from sf_app.service_table import serve
    except BaseException:
        traceback.print_exc()
        os._exit(1)  # not a service yet: nothing of it to wind down
    serve(service)
    sys.exit(0)


# ------------------------------------------------------------------ the client


class ForkServerGone(Exception):
    """The server exited (or was killed): it starts nothing more."""


@dataclass
class ForkServer:
    """The run's side of one server: start processes, learn how they ended."""

    process: subprocess.Popen[bytes]
    import_env: dict[str, str]
    exits: dict[int, int] = field(default_factory=dict)
    """pid -> exit code of the children that ended."""
    loaded: list[str] = field(default_factory=list)
    gone: bool = False
    _buffer: bytes = b""
    _started: list[int] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def launch(cls, env: dict[str, str]) -> ForkServer:
        """Start a server with ``env`` (it imports ``PRELOAD`` in the background)."""
        process = subprocess.Popen(
            [sys.executable, "-m", "sf_app.run.forkserver"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return cls(process, import_settings_of(env))

    def serves(self, env: dict[str, str]) -> bool:
        return not self.gone and import_settings_of(env) == self.import_env

    def wait_ready(self, timeout_s: float) -> str | None:
        """Block until the server has imported ``PRELOAD``: None, or why it will not
        serve (it refused, exited, or took longer than ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self.loaded:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.close()
                    return f"not ready within {timeout_s:g} s"
                for message in self._read(left):
                    if "refused" in message:
                        self.close()
                        return str(message["refused"])
                    self.loaded = list(message.get("ready", []))
                if self.gone:
                    return f"exited with code {self.process.poll()}"
        return None

    def start(self, service: str, env: dict[str, str], log: Path) -> ForkedProcess:
        """Fork a child that runs ``service`` with ``env``, writing to ``log``."""
        if not self.serves(env):
            raise ValueError("this fork server was started with another environment")
        request = {"service": service, "env": env, "log": str(log), "cwd": os.getcwd()}
        line = json.dumps(request) + "\n"
        with self._lock:
            assert self.process.stdin is not None
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except (BrokenPipeError, OSError):
                self.gone = True
            while not self._started and not self.gone:
                self._read(None)
            if not self._started:
                raise ForkServerGone(f"the fork server exited ({self.process.poll()})")
            pid = self._started.pop(0)
        return ForkedProcess(pid, self)

    def exit_code(self, pid: int, timeout_s: float | None = 0) -> int | None:
        """How ``pid`` ended, waiting up to ``timeout_s`` (None: for ever); None while it
        runs. A child of a server that is gone reports 1 once it has ended: its code
        went with the server. Waits by polling, never holding the lock: the run's loop
        polls its processes while a stop waits for them in a thread."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                if not self.gone:
                    self._read(0)
                if pid not in self.exits and self.gone:
                    try:
                        os.kill(pid, 0)
                    except ProcessLookupError:
                        self.exits[pid] = 1
                if pid in self.exits:
                    return self.exits[pid]
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(EXIT_POLL_S)

    def _read(self, timeout_s: float | None) -> list[dict[str, Any]]:
        """What the server has said within ``timeout_s``; records starts and exits."""
        stdout = self.process.stdout
        assert stdout is not None
        fd = stdout.fileno()
        readable, _, _ = select.select([fd], [], [], timeout_s)
        if not readable:
            return []
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            self.gone = True
            self.process.wait()
            stdout.close()
            return []
        self._buffer += chunk
        messages = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            message = json.loads(line)
            if "started" in message:
                self._started.append(int(message["started"]))
            elif "exited" in message:
                self.exits[int(message["exited"])] = int(message["code"])
            messages.append(message)
        return messages

    def close(self) -> None:
        """Stop the server (its children go on). Idempotent."""
        self.gone = True
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()  # the server's cue to exit
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()


class ForkedProcess:
    """A child of a fork server, handled as a ``subprocess.Popen``: ``pid``, ``poll``,
    ``wait``, ``send_signal``, ``terminate``, ``kill``, ``returncode``."""

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # only while it runs: once reaped, its pid may be another process's
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    serve_forks()
