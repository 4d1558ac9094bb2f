"""The CLI and the documented configuration: the configuration doc is generated from the
code, ``--help`` lists the commands without importing torch (a fresh Python), and the
service table names every service once, each with a ``python -m`` entry that runs it and
settings that load. The service skeleton's shutdown path and ``serve``'s refusal are
tests/service/test_cli_and_skeleton.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sf_app.cli import configuration_reference
from tests.support import REPO_ROOT

ROOT = REPO_ROOT


def test_the_configuration_doc_is_generated_from_the_code() -> None:
    documented = (ROOT / "docs" / "configuration.md").read_text()
    assert documented == configuration_reference(), (
        "run: seamlessflow config > docs/configuration.md"
    )


def test_help_lists_the_commands_without_importing_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sf_app", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert {"up", "serve", "build-model", "bench", "config"} <= set(out.split())
    # heavy imports happen inside commands: --help must not import torch
    probe = subprocess.run(
        [sys.executable, "-c", "import sys, sf_app.cli; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # (how fast that is belongs to no test: a wall-clock bound failed on a loaded machine)
    assert probe == "False"


def test_the_service_table_names_every_service_once_and_each_loads() -> None:
    """One table (``sf_app.service_table``) lists the services for ``serve``, ``config``
    and the embedded run: each names a package whose ``python -m`` entry runs that
    service, and settings that load."""
    import importlib.util

    from sf_app.service_table import SERVICE_TABLE, load, spec_of

    assert len({spec.name for spec in SERVICE_TABLE}) == len(SERVICE_TABLE)
    for spec in SERVICE_TABLE:
        assert load(spec.settings)().model_config["env_prefix"].startswith("SF_")
        main_module = importlib.util.find_spec(f"{spec.module}.__main__")
        assert main_module is not None and main_module.origin is not None, spec
        entry = Path(main_module.origin).read_text()
        if spec.optional:  # an HTTP server beside the mesh (the built-in environment)
            assert "run_process" not in entry and "seamlessflow.bus" not in entry
            continue
        [(name, started)] = re.findall(r'run_(?:service_)?process\("([a-z-]+)", (\w+)\)', entry)
        assert name == spec.name, main_module.origin
        [source] = re.findall(rf"from (\S+) import {started}\b", entry)
        started_object = load(f"{source}:{started}")
        # a service class carries its name; the trainer's entry is a function
        assert getattr(started_object, "name", spec.name) == spec.name
    assert {spec.module for spec in SERVICE_TABLE} >= {
        path.parent.name for path in (ROOT / "services").glob("sf_*/__main__.py")
    }
    with pytest.raises(ValueError, match="unknown service 'nope'"):
        spec_of("nope")
