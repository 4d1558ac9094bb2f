"""The "code_tests" verifier: the fraction of the reference's tests the completion's code
passes, run in the sandbox (``seamlessflow.rewards.sandbox``).

**The code** is the completion's last fenced block labelled ``python`` / ``py`` /
``python3``, else its last unlabelled fenced block, else the whole completion.

**The reference** (a task's ``reference`` column) is one of:
- a JSON object ``{"tests": [...], "setup": "..."}``: each entry of ``tests`` is one test
  (Python source, usually one ``assert``); ``setup`` (optional) runs after the solution
  and before the tests (imports, helpers). ``tests`` may also be one string of Python
  source, split as below;
- a JSON list of test strings;
- plain Python source: each top-level statement is one test, except imports, function
  and class definitions and assignments, which are setup (so MBPP-style lines of
  ``assert`` and HumanEval-style ``def check(...)`` + ``check(f)`` both work).

**The reward** is passed / total tests, in [0, 1]; 0 when the code does not compile or
raises at import, and tests that a timeout or a crash cut off count as failed. The
tests run in one process (a timeout covers them all), with the standard library only.

A completion never makes this raise; a malformed reference does (``ValueError``), since
that is a bug in the data, not a bad answer.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass
from typing import TypeGuard

from seamlessflow.rewards.registry import register_reward
from seamlessflow.rewards.sandbox import run_tests

log = logging.getLogger(__name__)

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_LABELS = ("python", "py", "python3")
_SETUP_STATEMENTS = (
    ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
    ast.Assign, ast.AnnAssign,
)  # fmt: skip


@dataclass(frozen=True)
class CodeTestSuite:
    tests: tuple[str, ...]
    setup: str = ""


def extract_code(completion_text: str) -> str:
    blocks = _FENCE.findall(completion_text)
    for wanted in (lambda label: label.lower() in _PYTHON_LABELS, lambda label: not label):
        chosen = [body for label, body in blocks if wanted(label)]
        if chosen:
            return str(chosen[-1])
    return completion_text


def split_python_tests(source: str) -> CodeTestSuite:
    """Top-level statements of ``source``: setup ones (imports, definitions,
    assignments) and tests (every other one)."""
    try:
        statements = ast.parse(source).body
    except SyntaxError as error:
        raise ValueError(f"the reference's tests are not valid Python: {error}") from None
    setup = [ast.unparse(s) for s in statements if isinstance(s, _SETUP_STATEMENTS)]
    tests = [ast.unparse(s) for s in statements if not isinstance(s, _SETUP_STATEMENTS)]
    return CodeTestSuite(tests=tuple(tests), setup="\n".join(setup))


def parse_test_suite(reference: str) -> CodeTestSuite:
    """The tests a reference holds (module docstring); ValueError if it holds none."""
    suite = _parse_reference(reference)
    if not suite.tests:
        raise ValueError(f"the reference holds no tests: {reference[:200]!r}")
    return suite


def _parse_reference(reference: str) -> CodeTestSuite:
    if not reference.lstrip().startswith(("{", "[")):
        return split_python_tests(reference)
    try:
        spec = json.loads(reference)
    except json.JSONDecodeError:
        return split_python_tests(reference)  # Python that starts with a bracket
    if _is_list_of_strings(spec):
        return CodeTestSuite(tests=tuple(spec))
    if not isinstance(spec, dict) or not set(spec) <= {"tests", "setup"}:
        raise ValueError(f'expected {{"tests": [...], "setup": "..."}}, got {reference[:200]!r}')
    setup = spec.get("setup", "")
    tests = spec.get("tests")
    if not isinstance(setup, str):
        raise ValueError(f'"setup" must be a string of Python, got {type(setup).__name__}')
    if isinstance(tests, str):
        split = split_python_tests(tests)
        return CodeTestSuite(
            tests=split.tests, setup="\n".join(s for s in (setup, split.setup) if s)
        )
    if not _is_list_of_strings(tests):
        raise ValueError(f'"tests" must be a list of strings or a string, got {tests!r:.200}')
    return CodeTestSuite(tests=tuple(tests), setup=setup)


def _is_list_of_strings(value: object) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


@register_reward("code_tests")
def code_tests(completion_text: str, reference: str) -> float:
    """Fraction of the reference's tests the completion's code passes (module docstring).
    Blocks for up to ``SF_REWARD_CODE_TIMEOUT_S``."""
    suite = parse_test_suite(reference)
    result = run_tests(extract_code(completion_text), suite.tests, suite.setup)
    log.debug(
        "code_tests: %d/%d passed, solution %s, timed out %s, exit %d",
        result.passed, len(result.outcomes), result.solution_error or "ok",
        result.timed_out, result.exit_code,
    )  # fmt: skip
    return result.fraction
