"""How to reach a run: the connection details ``seamlessflow up`` writes to its run
directory, for the user's own agents and for the CLI (``--run-dir``).

``runs/<run-id>/connection.json`` holds the run's NATS URL and token and its gateway URL
and operator key. It is created readable by its owner only (mode 0600) and is the one
file of the run directory that holds secrets; both die with the run (the embedded NATS
server and gateway stop with it). A run directory that is shared must leave it out.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

CONNECTION_FILE = "connection.json"


class NoConnection(Exception):
    """The directory holds no readable connection details."""


@dataclass(frozen=True)
class RunConnection:
    run_id: str
    nats_url: str
    nats_token: str
    """Empty when the NATS server takes no token."""
    gateway_url: str
    """The gateway's HTTP API, as agents on this machine reach it."""
    gateway_key: str
    """An operator key: ``Authorization: Bearer <key>`` on ``POST /sessions``."""

    def write(self, run_dir: Path) -> Path:
        """Write ``connection.json`` so that only the owner can read it, also when a
        file of that name was there (a resumed run id)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / CONNECTION_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a new file
        with os.fdopen(fd, "w") as out:
            json.dump(asdict(self), out, indent=2)
            out.write("\n")
        return path

    @classmethod
    def read(cls, run_dir: Path) -> RunConnection:
        path = run_dir / CONNECTION_FILE
        try:
            fields = json.loads(path.read_text())
            return cls(**{name: str(fields[name]) for name in cls.__dataclass_fields__})
        except FileNotFoundError:
            raise NoConnection(
                f"{path} does not exist: pass the directory of a run that "
                "`seamlessflow up` started (runs/<run-id>)"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise NoConnection(f"{path} is not a readable connection file: {exc}") from None

    def attach_instructions(self, run_dir: Path) -> str:
        """What ``seamlessflow up`` prints: how an external agent joins this run."""
        path = run_dir / CONNECTION_FILE
        return "\n".join(
            [
                f"Attach your own agent to run {self.run_id}: gateway {self.gateway_url}",
                f"  connection details (only you can read them): {path}",
                "  open a session:   POST /sessions with "
                "'authorization: Bearer <gateway_key from that file>'",
                "                    -> base_url + api_key for any OpenAI client",
                f"  export a session: seamlessflow export <session_id> --run-dir {run_dir}",
            ]
        )
