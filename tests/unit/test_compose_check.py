"""The pieces of `just compose-test` (loadtests/compose_check.py) that need no Docker:
where the base image's packages come from, the names the local images are given to the
compose file, and the trainer log lines the check waits for. The check itself builds and
runs the stack in real containers: `.ci/run` runs it after the suite."""

from __future__ import annotations

import re
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import REPO_ROOT, load_loadtest
from tests.support.compose_render import render

ROOT = REPO_ROOT
SECRETS = {"SF_NATS_TOKEN": "token", "SF_GATEWAY_API_KEYS": "key"}


@pytest.fixture(scope="module")
def check() -> ModuleType:
    module: ModuleType = load_loadtest("compose_check")
    return module


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_mirror_is_the_deb822_stanza_of_the_suite_not_the_security_one(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SF_DEBIAN_MIRROR", raising=False)
    write(
        tmp_path / "sources.list.d" / "debian.sources",
        "Types: deb\n# http://old.example/debian\nURIs: http://security.example/debian-security\n"
        "Suites: bookworm-security\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\n",
    )
    assert check.debian_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    with pytest.raises(check.CheckFailed, match="SF_DEBIAN_MIRROR"):
        check.debian_mirror("trixie", tmp_path)


def test_the_mirror_from_a_one_line_source_with_options(
    check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SF_DEBIAN_MIRROR", raising=False)
    write(
        tmp_path / "sources.list",
        "# deb http://commented.example/debian bookworm main\n"
        "deb-src http://src.example/debian bookworm main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main\n",
    )
    assert check.debian_mirror("bookworm", tmp_path) == "http://mirror.example/debian"
    monkeypatch.setenv("SF_DEBIAN_MIRROR", "http://chosen.example/debian")
    assert check.debian_mirror("bookworm", tmp_path) == "http://chosen.example/debian"


def test_variables_name_the_images_and_the_defaults_stay_the_registry_ones() -> None:
    compose = ROOT / "compose" / "docker-compose.yml"
    default = render(compose, SECRETS)["services"]
    assert default["nats"]["image"] == "nats:2.15-alpine"
    assert default["jaeger"]["image"].startswith("jaegertracing/jaeger:")
    assert default["build-model"]["build"]["args"]["PYTHON_IMAGE"] == "python:3.11-slim"

    local = {
        "SF_NATS_IMAGE": "sf-local/nats:2.15.1",
        "SF_JAEGER_IMAGE": "sf-local/trace-collector:x",
        "SF_PYTHON_IMAGE": "sf-local/debian-python:bookworm",
    }
    services = render(compose, {**SECRETS, **local})["services"]
    assert services["nats"]["image"] == local["SF_NATS_IMAGE"]
    assert services["jaeger"]["image"] == local["SF_JAEGER_IMAGE"]
    built = [s for s in services.values() if "build" in s]
    assert built and all(
        s["build"]["args"]["PYTHON_IMAGE"] == local["SF_PYTHON_IMAGE"] for s in built
    )
    gpu = render(compose, {**SECRETS, **local}, profiles=["gpu"])["services"]
    assert gpu["trainer-gpu"]["build"]["args"]["PYTHON_IMAGE"] == local["SF_PYTHON_IMAGE"]
    # the Dockerfile builds on it
    assert re.search(
        r"^FROM \$\{PYTHON_IMAGE\}$", (ROOT / "compose" / "Dockerfile").read_text(), re.M
    )


def source_format(path: Path, prefix: str) -> str:
    """The printf-style log format in ``path`` that starts with ``prefix``."""
    match = re.search(r'"(' + re.escape(prefix) + r'[^"]*)"', path.read_text())
    assert match, f"{path}: no log format starting {prefix!r}"
    return match[1]


def test_the_log_lines_the_check_waits_for_are_the_trainers(check: ModuleType) -> None:
    services = ROOT / "services" / "sf_trainer"
    saved = source_format(services / "checkpoint.py", "checkpoint %s: step %d") % (
        "/runs/r/checkpoints/step-000012",
        12,
        12,
        12,
        12,
    )
    assert check.checkpoint_steps(f"noise\n{saved}\nmore") == [12]
    resumed = source_format(services / "learner.py", "resumed from %s: step %d") % (
        "/runs/r/checkpoints/step-000012",
        12,
        12,
        12,
    )
    assert re.search(check.RESUMED, resumed)[1] == "12"  # type: ignore[index]


def test_a_wheel_name_goes_to_its_normalized_project_folder(check: ModuleType) -> None:
    assert check.normalized("typing_extensions") == "typing-extensions"
    assert check.normalized("MarkupSafe") == "markupsafe"
    assert check.normalized("zope.interface") == "zope-interface"


@pytest.mark.parametrize(
    ("cli", "daemon", "dockerd", "steps"),
    [
        (False, False, False, ["install docker.io", "start dockerd"]),  # nothing
        (True, False, False, ["install docker.io", "start dockerd"]),  # a CLI, no engine
        (True, False, True, ["start dockerd"]),  # installed, not running
        (True, True, True, []),  # running
    ],
)
def test_docker_parts_a_machine_lacks_are_installed_or_started(
    check: ModuleType, cli: bool, daemon: bool, dockerd: bool, steps: list[str]
) -> None:
    """A fresh machine may ship a docker CLI without a daemon: the CLI alone must not
    stop the check (it did: CI passed only where docker.io had been installed by hand)."""
    assert check.docker_steps(cli, daemon, dockerd) == steps
