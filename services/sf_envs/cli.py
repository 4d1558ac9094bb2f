"""``python -m sf_envs [NAME] [options]``: serve a built-in environment.

    python -m sf_envs guess_number --host 127.0.0.1 --port 8011 \\
        --step-latency-ms 100 --sigma 0.5 --seed 0 --upper 1000 --max-turns 12

Every option defaults to its ``SF_ENV_*`` variable (``sf_envs.settings``), then to the
run file's ``[env]`` section (``SF_CONFIG``), then to the built-in default. Prints
``listening on http://HOST:PORT`` once serving; an address it cannot bind, or an
invalid setting, is one line on stderr and exit code 78 (a restart would fail the same
way). It speaks HTTP and WebSocket only: no NATS.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn, get_args

from pydantic import ValidationError

from sf_envs.settings import EnvironmentName, EnvServerSettings

OPTIONS = {
    "--host": "host",
    "--port": "port",
    "--step-latency-ms": "step_latency_ms",
    "--sigma": "step_latency_sigma",
    "--seed": "seed",
    "--max-sessions": "max_sessions",
    "--upper": "upper",
    "--max-turns": "max_turns",
}
"""Command-line option -> settings field (its docstring is the option's help)."""

PARSERS: dict[object, Callable[[str], object]] = {int: int, float: float}
"""A field's type -> how its option's text is read (str otherwise)."""

PROCESS_NAME = "env"
"""The name this process goes by in the service table and in its one-line errors."""

EXIT_CANNOT_START = 78
"""Exit code when the settings or the address are wrong: the mesh's
``EXIT_UNRECOVERABLE`` (``EX_CONFIG``), which tells a supervisor that restarting with the
same settings would fail the same way."""


def parse(argv: list[str]) -> EnvServerSettings:
    """The settings to serve with (options over variables over the run file); invalid
    ones raise pydantic's ValidationError."""
    parser = argparse.ArgumentParser(
        prog="python -m sf_envs",
        description="Serve a built-in OpenEnv environment (HTTP and WebSocket /ws).",
    )
    fields = EnvServerSettings.model_fields
    parser.add_argument(
        "name",
        nargs="?",
        choices=get_args(EnvironmentName),
        help=f"{fields['name'].description} [SF_ENV_NAME, else {fields['name'].default}]",
    )
    for option, field in OPTIONS.items():
        parser.add_argument(
            option,
            dest=field,
            metavar=field.upper(),
            type=PARSERS.get(fields[field].annotation, str),
            default=None,
            help=f"{fields[field].description} [SF_ENV_{field.upper()}]".replace("%", "%%"),
        )
    args = vars(parser.parse_args(argv))
    given = {field: value for field, value in args.items() if value is not None}
    return EnvServerSettings(**given)


def main(argv: list[str] | None = None) -> None:
    """Parse, then serve until stopped; every failure to start is one line on stderr."""
    try:
        settings = parse(sys.argv[1:] if argv is None else argv)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors()
        )
        fail(f"invalid settings: {problems}")
    from sf_envs.server import CannotListen, run

    try:
        run(settings)
    except CannotListen as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        raise SystemExit(130) from None


def fail(line: str) -> NoReturn:
    print(f"{PROCESS_NAME}: {line}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_CANNOT_START)
