"""The built-in OpenEnv server (``python -m sf_envs``) as a process on a free port,
for the tests of environment sessions and of the agent that plays them."""

from __future__ import annotations

import select
import signal
import subprocess
import sys


class EnvServer:
    """``python -m sf_envs guess_number`` on a free port, for one test or one module."""

    def __init__(self, *options: str, command: tuple[str, ...] | None = None) -> None:
        self.process = subprocess.Popen(
            command or (sys.executable, "-m", "sf_envs", "guess_number", "--port", "0", *options),
            stdout=subprocess.PIPE,
            text=True,
        )
        self.url = self._read_url(timeout_s=60)

    def _read_url(self, timeout_s: float) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("listening on http://"):
            self.stop()
            raise AssertionError(f"no listening line within {timeout_s} s: {line!r}")
        return line.removeprefix("listening on ").strip()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        self.process.wait(timeout=15)
        if self.process.stdout is not None:
            self.process.stdout.close()
