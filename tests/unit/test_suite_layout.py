"""The suite's own layout: a package whose tests import helpers only from
``tests.support``, never from one another, and never reach other modules by putting
folders on ``sys.path``."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import SUPPORT_DIR, TESTS_DIR

SUITE_FOLDERS = ("unit", "service", "mesh")


def suite_modules() -> list[Path]:
    """Every Python file of the suite outside tests/support/."""
    return sorted(path for path in TESTS_DIR.rglob("*.py") if SUPPORT_DIR not in path.parents)


def local_module_names() -> set[str]:
    """Names a bare import would find in the suite's folders if they were on sys.path:
    its modules and its packages (``support``)."""
    files = list(TESTS_DIR.rglob("*.py"))
    return {p.stem for p in files if p.stem != "__init__"} | {
        p.parent.name for p in files if p.stem == "__init__" and p.parent != TESTS_DIR
    }


def forbidden_imports(path: Path, local_names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append(f"relative import from {'.' * node.level}{node.module or ''}")
            continue
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module]
        else:
            continue
        for module in modules:
            first = module.split(".")[0]
            if first == "tests" and module != "tests.support":
                if not module.startswith("tests.support."):
                    found.append(module)
            elif first in local_names:
                found.append(module)
    return found


def sys_path_changes(path: Path) -> list[int]:
    """Lines that change ``sys.path`` (a call of one of its methods, or an assignment).
    pytest's ``monkeypatch.syspath_prepend`` is not one: a test that plays a user's own
    module outside the repo puts its tmp folder first, and pytest takes it away after."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func.value
        elif isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, ast.Attribute)), None)
        if (
            isinstance(target, ast.Attribute)
            and target.attr == "path"
            and isinstance(target.value, ast.Name)
            and target.value.id == "sys"
        ):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_suite_is_a_package_of_three_folders_and_its_support() -> None:
    for folder in ("", *SUITE_FOLDERS, "support"):
        assert (TESTS_DIR / folder / "__init__.py").is_file(), folder
    assert not [
        p.name for p in TESTS_DIR.glob("*.py") if p.name not in {"__init__.py", "conftest.py"}
    ]
    stray = {p.parent.name for p in TESTS_DIR.glob("*/test_*.py")} - set(SUITE_FOLDERS)
    assert not stray, f"test modules outside {SUITE_FOLDERS}: {stray}"


def test_tests_import_helpers_only_from_tests_support() -> None:
    local_names = local_module_names()
    offenders = {
        str(path.relative_to(TESTS_DIR)): found
        for path in suite_modules()
        if (found := forbidden_imports(path, local_names))
    }
    assert not offenders


def test_support_does_not_import_the_tests() -> None:
    local_names = local_module_names() - {p.stem for p in SUPPORT_DIR.glob("*.py")}
    offenders = {
        path.name: found
        for path in SUPPORT_DIR.glob("*.py")
        if (found := forbidden_imports(path, local_names))
    }
    assert not offenders


def test_nothing_in_the_suite_puts_folders_on_sys_path() -> None:
    offenders = {
        str(path.relative_to(TESTS_DIR)): lines
        for path in TESTS_DIR.rglob("*.py")
        if (lines := sys_path_changes(path))
    }
    assert not offenders


def test_the_layout_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    """The checks above fail on the imports and path changes they forbid."""
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import sys\nfrom test_faults import run_store\nfrom tests.mesh.test_x import y\n"
        "from .helpers import z\nfrom tests.support.store import stored\n"
        "sys.path.insert(0, 'x')\nsys.path = []\n"
    )
    found = forbidden_imports(bad, {"test_faults"})
    assert sorted(found) == ["relative import from .helpers", "test_faults", "tests.mesh.test_x"]
    # a helper package reached by its bare name, as when tests/ was on sys.path
    inside = tmp_path / "test_inside.py"
    inside.write_text("def f():\n    from support import InProcessMesh\n")
    assert forbidden_imports(inside, local_module_names()) == ["support"]
    assert sys_path_changes(bad) == [6, 7]
