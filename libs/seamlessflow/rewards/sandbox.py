"""Run untrusted Python code against tests in a separate, limited process.

``run_tests(solution, tests)`` starts ``python -I -S sandbox_harness.py`` (the harness
documents its protocol) and returns one outcome per test. What stands between the
untrusted code and the machine:
- **a separate process** in its own session and process group, in a fresh temporary
  working directory that is deleted afterwards, with a minimal environment (``PATH``,
  ``HOME`` and ``TMPDIR`` pointing into that directory, ``LANG``): none of the caller's
  variables (tokens, passwords) are inherited; ``-I -S`` also ignores ``PYTHON*``
  variables and site-packages, so the code sees the standard library only;
- **stdin** is empty; **stdout / stderr** go to files capped by the file-size limit, of
  which the first ``output_chars`` characters are kept (for logs);
- **resource limits** set before the code runs: address space (``memory_mb``), CPU
  seconds (``ceil(timeout_s)``, then SIGKILL), largest file written (``file_size_mb``),
  64 open files, no core dumps, no processes (``RLIMIT_NPROC`` 0, which Linux ignores
  for root: hence the filter below);
- **a seccomp filter** (Linux x86-64): no new processes or threads, no sockets (so no
  network, local sockets included), no signals to other processes, no ptrace, no
  mounts, module loading, io_uring or the like. Elsewhere the run goes on without it
  and the result says so (``seccomp=False``; a warning is logged);
- **a wall-clock timeout** (``timeout_s``), after which the whole process group is
  killed; the harness reports each test as it finishes, so the tests that passed
  before a hang still count.

What it does NOT isolate - a production deployment that runs code written by a model
under training should add a container or a jail (nsjail, bubblewrap, gVisor) with a
read-only root, no network namespace and an unprivileged user, on a throwaway host:
- **the file system**: the code runs as the caller's user and can read every file that
  user can read (keys in its home, ``/proc/<pid>/environ`` of the caller's other
  processes) and write where that user can write (as root: anywhere), each file at most
  ``file_size_mb``, without any cap on their number or total size;
- **already open files and the harness itself**: code that inspects its own process
  (the harness's frames, ``gc``) can find the nonce and forge results; the sandbox
  only stops the easy routes (exiting early, printing, patching builtins);
- **other architectures**: without the seccomp filter a process as root can create
  processes (killed with the group at the end, unless they start a new session) and
  open network connections;
- **timing and side channels**, kernel exploits, and the CPU/memory the code may use
  up to its limits while it runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings

log = logging.getLogger(__name__)

HARNESS = Path(__file__).with_name("sandbox_harness.py")
NOT_RUN = "not run"
"""Outcome of a test the harness never reported (the run died or timed out first)."""


class SandboxSettings(RunFileSettings):
    """Limits of the code sandbox used by the ``code_tests`` reward (env prefix
    ``SF_REWARD_CODE_``); read by the process that computes rewards."""

    model_config = SettingsConfigDict(
        env_prefix="SF_REWARD_CODE_", extra="ignore", use_attribute_docstrings=True
    )

    timeout_s: float = 10.0
    """Wall-clock limit of one run (the solution and all its tests); the process group is
    killed then. The CPU-time limit is this, rounded up."""

    memory_mb: int = 1024
    """Address-space limit of the sandboxed process (``RLIMIT_AS``), in MiB."""

    file_size_mb: int = 16
    """Largest file the sandboxed code may write, captured output included, in MiB."""

    output_chars: int = 4000
    """How much of the sandboxed code's stdout and stderr is kept (for logs)."""


@dataclass(frozen=True)
class SandboxResult:
    outcomes: tuple[str, ...]
    """Per test: ``pass``, ``fail <ExceptionName>`` or ``not run``."""
    solution_error: str | None
    """``fail <ExceptionName>`` when the solution or setup code itself raised."""
    timed_out: bool
    """Killed at the wall-clock timeout."""
    exit_code: int
    """The process's exit status (negative: the signal that killed it)."""
    seccomp: bool
    """Whether the seccomp filter was in place."""
    stdout: str
    stderr: str

    @property
    def passed(self) -> int:
        return self.outcomes.count("pass")

    @property
    def fraction(self) -> float:
        return self.passed / len(self.outcomes) if self.outcomes else 0.0


def run_tests(
    solution: str,
    tests: Sequence[str],
    setup: str = "",
    settings: SandboxSettings | None = None,
) -> SandboxResult:
    """Run ``solution``, then ``setup``, then each test (Python source) in one sandboxed
    process (module docstring); blocks for at most about ``settings.timeout_s``."""
    settings = settings or SandboxSettings()
    nonce = secrets.token_hex(16)
    job = {
        "nonce": nonce,
        "solution": solution,
        "setup": setup,
        "tests": list(tests),
        "limits": {
            "cpu_s": math.ceil(settings.timeout_s),
            "memory_bytes": settings.memory_mb * 2**20,
            "file_size_bytes": settings.file_size_mb * 2**20,
        },
    }
    with tempfile.TemporaryDirectory(prefix="sf-sandbox-", ignore_cleanup_errors=True) as tmp:
        root = Path(tmp)
        workdir = root / "work"
        workdir.mkdir()
        with (
            open(root / "stdout", "wb") as stdout,
            open(root / "stderr", "wb") as stderr,
            open(root / "results", "wb") as results,
        ):
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(HARNESS), str(results.fileno())],
                stdin=subprocess.PIPE,
                bufsize=0,
                stdout=stdout,
                stderr=stderr,
                cwd=workdir,
                env=minimal_environment(workdir),
                pass_fds=(results.fileno(),),
                start_new_session=True,
            )
            timed_out = feed_and_wait(process, json.dumps(job).encode(), settings.timeout_s)
        reported = read_results(root / "results", nonce)
        result = SandboxResult(
            outcomes=tuple(reported.get(str(i), NOT_RUN) for i in range(len(tests))),
            solution_error=reported.get("solution"),
            timed_out=timed_out,
            exit_code=process.returncode,
            seccomp=reported.get("seccomp") == "on",
            stdout=read_head(root / "stdout", settings.output_chars),
            stderr=read_head(root / "stderr", settings.output_chars),
        )
    if "seccomp" in reported and not result.seccomp:
        log.warning("code sandbox without its seccomp filter (needs Linux on x86-64)")
    return result


def minimal_environment(workdir: Path) -> dict[str, str]:
    return {"PATH": os.defpath, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}


def feed_and_wait(process: subprocess.Popen[bytes], job: bytes, timeout_s: float) -> bool:
    """Send the job, wait for the process to exit or the timeout, then kill its process
    group and reap it. True iff the timeout struck.

    The group is killed while the leader is not yet reaped (a pidfd reports its exit
    without reaping it), so the group id cannot have been reused by then.
    """
    deadline = time.monotonic() + timeout_s
    assert process.stdin is not None  # unbuffered: closing it never flushes, so never raises
    with process.stdin as stdin, contextlib.suppress(BrokenPipeError):
        unsent = memoryview(job)
        while unsent:
            unsent = unsent[stdin.write(unsent) :]
    # BrokenPipeError: the harness died before reading its job; its exit status tells.
    pidfd = os.pidfd_open(process.pid)
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        exited = bool(poller.poll(max(deadline - time.monotonic(), 0.0) * 1000))
    finally:
        os.close(pidfd)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    return not exited


def read_results(path: Path, nonce: str) -> dict[str, str]:
    """Key -> outcome from the harness's lines; lines without the nonce are forged."""
    reported: dict[str, str] = {}
    for line in path.read_text(errors="replace").splitlines():
        line_nonce, _, rest = line.partition(" ")
        key, _, outcome = rest.partition(" ")
        if line_nonce == nonce and key not in reported:
            reported[key] = outcome
    return reported


def read_head(path: Path, chars: int) -> str:
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.read(chars)
