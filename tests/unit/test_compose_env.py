"""``seamlessflow compose-env`` (``just compose-up``'s first step): compose's env file
with fresh secrets, readable by its owner only, never overwritten."""

from __future__ import annotations

import stat
from pathlib import Path

from typer.testing import CliRunner

from sf_app.cli import COMPOSE_SECRETS, app


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_fresh_secrets_owner_only_and_kept_on_the_next_start(tmp_path: Path) -> None:
    path = tmp_path / "compose" / ".env"
    first = CliRunner().invoke(app, ["compose-env", str(path)])
    assert first.exit_code == 0, first.output
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    values = read_env(path)
    assert set(values) == set(COMPOSE_SECRETS)
    assert all(
        len(v) >= 32 and v.replace("-", "").replace("_", "").isalnum() for v in values.values()
    )
    again = CliRunner().invoke(app, ["compose-env", str(path)])
    assert again.exit_code == 0 and "kept" in again.output
    assert read_env(path) == values  # the running stack's secrets are not replaced
    other = tmp_path / "other.env"
    CliRunner().invoke(app, ["compose-env", str(other)])
    assert read_env(other) != values  # fresh each time a file is written


def test_an_existing_file_without_a_secret_is_named_not_overwritten(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text("SF_NATS_TOKEN=abc\n")
    result = CliRunner().invoke(app, ["compose-env", str(path)])
    assert result.exit_code != 0
    assert "SF_GATEWAY_API_KEYS" in result.output
    assert path.read_text() == "SF_NATS_TOKEN=abc\n"


def test_an_existing_file_others_can_read_is_kept_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    path.write_text("".join(f"{name}=x\n" for name in COMPOSE_SECRETS))
    path.chmod(0o644)
    result = CliRunner().invoke(app, ["compose-env", str(path)])
    assert result.exit_code == 0
    assert "readable by others" in result.output and "chmod 600" in result.output
