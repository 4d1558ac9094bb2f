"""The shared test helpers of tests/support/ that every other test leans on: ports
that differ, ``eventually`` (a poll with a deadline naming what never came), and the
tool-script engine's choice of answer (a call of the offered tool)."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from tests.support import REPO_ROOT, SUPPORT_DIR, TESTS_DIR, eventually, free_port, free_ports
from tests.support.tool_script import scripted_reply


def test_free_ports_differ_and_can_be_bound() -> None:
    ports = free_ports(5)
    assert len(set(ports)) == 5
    for port in [*ports, free_port()]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_the_roots_are_the_repository_and_its_tests_folder() -> None:
    assert (REPO_ROOT / "pyproject.toml").exists() and TESTS_DIR == REPO_ROOT / "tests"
    assert (TESTS_DIR / "conftest.py").exists()
    assert SUPPORT_DIR == TESTS_DIR / "support" and (SUPPORT_DIR / "trainer_rank.py").exists()


async def test_eventually_returns_the_first_truthy_value_of_a_function_or_coroutine() -> None:
    calls: list[int] = []

    def counted() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert await eventually(counted, 5, "three calls", interval_s=0.001) == 3
    flag = asyncio.Event()
    asyncio.get_running_loop().call_soon(flag.set)

    async def is_set() -> bool:
        return flag.is_set()

    assert await eventually(is_set, 5, "the flag") is True


async def test_eventually_fails_naming_what_never_happened() -> None:
    with pytest.raises(AssertionError, match=r"not within 0\.05 s: the sky falls"):
        await eventually(lambda: False, 0.05, "the sky falls", interval_s=0.01)


def test_the_scripted_model_calls_the_offered_tool() -> None:
    tool = {"type": "function", "function": {"name": "mul", "parameters": {"properties": {
        "x": {}, "y": {}}}}}  # fmt: skip
    prompt = (
        f"<|im_start|>system\n# Tools\n<tools>\n{json.dumps(tool)}\n</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is 3 * 4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert scripted_reply(prompt) == (
        '<tool_call>\n{"name": "mul", "arguments": {"x": 3, "y": 4}}\n</tool_call>'
    )
