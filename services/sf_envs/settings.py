"""Settings of a built-in environment server (env prefix ``SF_ENV_``, run-file section
``[env]``; every one is also a ``python -m sf_envs`` option, which wins over both)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings, shared

EnvironmentName = Literal["guess_number"]
"""The environments ``python -m sf_envs`` serves (``sf_envs.server.ENVIRONMENTS``)."""


class EnvServerSettings(RunFileSettings):
    """One environment server: where it listens, how slow its steps are, the game."""

    model_config = SettingsConfigDict(
        env_prefix="SF_ENV_", extra="ignore", use_attribute_docstrings=True
    )

    name: EnvironmentName = "guess_number"
    """The environment to serve (the command line's first argument)."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` for every interface)."""

    port: int = Field(default=8011, ge=0, le=65535)
    """Port to listen on; 0 picks a free one. Either way the server prints
    ``listening on http://HOST:PORT`` once it accepts connections."""

    step_latency_ms: float = shared("env_step_latency_ms", ge=0.0)
    """Median time a step takes, in milliseconds (a stand-in for a slow environment:
    a browser, a sandbox, a simulator); 0 = answer at once. Each step waits a log-normal
    draw with this median and ``step_latency_sigma``, without holding up other sessions."""

    step_latency_sigma: float = shared("env_latency_sigma", ge=0.0)
    """Spread of the step latency: the sigma of the log-normal's underlying normal
    (0 = every step takes exactly the median; 0.5 = the middle 50% within 0.71x-1.40x)."""

    seed: int = 0
    """Seed of the server's latency draws (one generator for all sessions). The games'
    secrets are seeded per episode by ``reset(seed=...)``, not by this."""

    max_sessions: int = Field(default=1024, ge=1)
    """Most WebSocket sessions (episodes) open at once; one more is answered an error
    and closed. A session costs a few kilobytes and no thread (steps run on the event
    loop), so this only bounds a runaway client; keep it above the agents' concurrency
    (a run's 256 concurrent episodes fit four times)."""

    upper: int = Field(default=1000, ge=1)
    """guess_number: the secret is a whole number from 1 to this."""

    max_turns: int = Field(default=12, ge=1)
    """guess_number: guesses per episode (binary search needs ceil(log2(upper + 1)):
    10 for 1000)."""
