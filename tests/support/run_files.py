"""A run file (``seamlessflow.runfile``) written for a test: the TOML text as
``run.toml`` in the test's folder."""

from __future__ import annotations

from pathlib import Path


def write_run_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path
