"""The import picture: arrows only downward (docs/architecture.md, "The layers").

``sf_app`` (the application) -> ``sf_<service>`` -> ``seamlessflow`` (the library). Read
from the source with ``ast``, so a lazy import inside a function counts, and so does a
service named by a ``"module:attr"`` string (an import by name).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

ROOT = REPO_ROOT
OURS = re.compile(r"^(seamlessflow|sf_[a-z_]+)(?:[.:]|$)")


def packages_of(root: Path) -> dict[str, Path]:
    return {path.name: path for path in sorted(root.iterdir()) if (path / "__init__.py").exists()}


LIBRARY = packages_of(ROOT / "libs")
SERVICES = packages_of(ROOT / "services")
APPLICATION = packages_of(ROOT / "app")
KNOWN = set(LIBRARY) | set(SERVICES) | set(APPLICATION)


def our_references(package_dir: Path) -> dict[str, set[str]]:
    """Top-level packages of ours that each file imports or names in a string."""
    found: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                if " " not in node.value:
                    names.add(node.value)
        tops = {match.group(1) for name in names if (match := OURS.match(name))} & KNOWN
        found[str(path.relative_to(ROOT))] = tops
    return found


def test_the_three_layers_exist() -> None:
    assert set(LIBRARY) == {"seamlessflow"}
    assert set(APPLICATION) == {"sf_app"}
    assert len(SERVICES) >= 6 and all(name.startswith("sf_") for name in SERVICES)


@pytest.mark.parametrize("library", sorted(LIBRARY))
def test_the_library_imports_no_service_and_no_application(library: str) -> None:
    above = set(SERVICES) | set(APPLICATION)
    wrong = {
        path: sorted(tops & above)
        for path, tops in our_references(LIBRARY[library]).items()
        if tops & above
    }
    assert not wrong, wrong


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_service_imports_only_itself_and_the_library(service: str) -> None:
    allowed = {service, *LIBRARY}
    wrong = {
        path: sorted(tops - allowed)
        for path, tops in our_references(SERVICES[service]).items()
        if tops - allowed
    }
    assert not wrong, wrong


def test_only_the_bus_imports_the_nats_client() -> None:
    """``Bus`` is the only way into NATS (docs/architecture.md, "How the parts talk"):
    nats-py's client, JetStream context and errors are used in ``seamlessflow.bus`` only;
    the rest names its types through it."""
    importers = set()
    for root in ("app", "libs", "services"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module]
                else:
                    continue
                if any(name == "nats" or name.startswith("nats.") for name in names):
                    importers.add(str(path.relative_to(ROOT)))
    assert importers == {"libs/seamlessflow/bus.py"}
