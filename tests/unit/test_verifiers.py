"""The "math_answer" and "code_tests" verifiers, and the code sandbox under them: real
subprocesses running real hostile code (loops, memory and fork bombs, huge writes)."""

from __future__ import annotations

import json
import platform
import random
import signal
import struct
from typing import Any

import pytest

from seamlessflow.rewards import (
    code_match,
    code_tests,
    first_integer,
    get_reward,
    integer_match,
    math_answer,
    register_reward,
    sandbox,
)
from seamlessflow.rewards.code_verifier import extract_code, parse_test_suite
from seamlessflow.rewards.math_verifier import extract_answer
from seamlessflow.rewards.sandbox import SandboxResult, SandboxSettings, run_tests
from seamlessflow.rewards.sandbox_harness import DENIED_SYSCALLS_X86_64, seccomp_program

FAST = SandboxSettings(timeout_s=1.0, memory_mb=256, file_size_mb=1, output_chars=1000)
ADD_TESTS = ("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4")


def test_the_registry_keeps_its_names_and_import_paths() -> None:
    assert get_reward("math_answer") is math_answer
    assert get_reward("code_tests") is code_tests
    assert get_reward("seamlessflow.rewards:math_answer") is math_answer
    assert get_reward("integer_match") is integer_match and get_reward("code_match") is code_match
    assert first_integer("x = -12 or 3") == -12
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math_answer")(lambda completion, reference: 0.0)


MATH_CASES: list[tuple[str, str, float]] = [
    # (completion, reference, reward)
    ("So the answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
    ("\\boxed{\\dfrac{\\frac{1}{2}}{3}}", "\\frac{1}{6}", 1.0),  # nested braces
    ("first \\boxed{3}, then corrected: \\boxed{\\frac{3}{4}}", "0.75", 1.0),  # the last box
    ("\\boxed{0.5}", "\\frac{2}{4}", 1.0),  # decimal vs fraction, exactly
    ("\\boxed{\\left( \\frac{3}{2} \\right)}", "1.5", 1.0),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", 1.0),
    ("\\boxed{\\frac12}", "0.5", 1.0),
    ("\\boxed{3\\frac{1}{2}}", "7/2", 1.0),  # a mixed number
    ("The answer is 3 1/2.", "3.5", 1.0),
    ("The answer is $\\frac{3}{4}$.", "0.75", 1.0),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),
    ("so 72 clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # GSM8K reference
    ("Answer: 1,000,000", "1000000", 1.0),  # thousands separators
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("The final answer is 25%", "0.25", 1.0),  # percentages, either way
    ("The final answer is 25\\%", "25", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("It costs \\boxed{\\$12.50}", "12.5", 1.0),
    ("\\boxed{12 \\text{ cm}}", "12", 1.0),  # trailing units
    ("The answer is 7 apples.", "7", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),  # irrational: compared as floats
    ("\\boxed{2\\pi}", "6.283185307179586", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),  # not a number: normalised text
    ("we get −3", "-3", 1.0),  # unicode minus, last number
    ("4 + 5 = 9", "9", 1.0),
    ("\\boxed{0.33}", "1/3", 0.0),  # no rounding tolerance
    ("\\boxed{\\frac{1}{2}}", "0.25", 0.0),
    ("\\boxed{5}", "50%", 0.0),
    ("The answer is 12.", "13", 0.0),
    ("\\boxed{3} is wrong, the answer is \\boxed{4", "3", 0.0),  # unclosed last box
    ("no numbers here", "3", 0.0),
    ("", "3", 0.0),
    ("\\boxed{}", "", 0.0),
    ("\\boxed{\\frac{1}{0}}", "1", 0.0),
    ("\\boxed{9^9^9^9}", "1", 0.0),  # refused, not computed
    ("\\boxed{1e999999999}", "1", 0.0),
    ("\\boxed{x+1}", "1+x", 0.0),  # free variables: text only
    ("\\boxed{__import__('os').system('true')}", "0", 0.0),  # never evaluated as Python
]


@pytest.mark.parametrize(("completion", "reference", "expected"), MATH_CASES)
def test_math_answer(completion: str, reference: str, expected: float) -> None:
    assert math_answer(completion, reference) == expected


def test_extract_answer_rules() -> None:
    assert extract_answer("\\boxed{a{b}c} then \\boxed{d{e{f}}}") == "d{e{f}}"
    assert extract_answer("x\n#### 1,234\nnotes") == "1,234"
    assert extract_answer("The answer is: 12 cm\nbye") == "12 cm"
    assert extract_answer("3 then 4.5 then -1/2") == "-1/2"
    assert extract_answer("nothing") is None


def test_math_answer_never_raises_on_garbage_or_hostile_input() -> None:
    """Random token soup and inputs built to make a parser backtrack or recurse: a
    score, never an exception. (A pathological input that hung the verifier would hang
    this test; its speed is measured by no test.)"""
    tokens = [
        "\\boxed{", "{", "}", "\\frac", "\\sqrt", "^", "9", "0", ".", ",", "/", "-", "%",
        "$", " ", "answer is ", "####", "\\pi", "(", ")", "*", "e", "x", "=", "\n",
        "\\text{", "\\left", "−", "1e9", "**", "\\", "\x00", "\ud800", "[", "lambda",
    ]  # fmt: skip
    rng = random.Random(0)
    for _ in range(3000):
        completion = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 40)))
        reference = "".join(rng.choice(tokens) for _ in range(rng.randint(0, 6)))
        assert math_answer(completion, reference) in (0.0, 1.0)
    hostile = ["(" * 5000 + "1", "\\boxed{" * 5000, "1" * 100_000, "{" * 50_000 + "\\boxed{2}"]
    for completion in hostile:
        assert math_answer(completion, "2") in (0.0, 1.0)


def test_extract_code_prefers_the_last_python_block() -> None:
    text = "```python\nold = 1\n```\n```text\nout\n```\n```py\nnew = 2\n```\nbye"
    assert extract_code(text) == "new = 2\n"
    assert extract_code("```\nplain = 1\n```\n```bash\nls\n```") == "plain = 1\n"
    assert extract_code("def f():\n    return 1\n") == "def f():\n    return 1\n"


def test_references_hold_tests_in_several_forms() -> None:
    suite = parse_test_suite(json.dumps({"tests": ["assert f(1) == 2"], "setup": "import math"}))
    assert suite.tests == ("assert f(1) == 2",) and suite.setup == "import math"
    assert parse_test_suite('["assert f(1)", "assert f(2)"]').tests == (
        "assert f(1)",
        "assert f(2)",
    )
    humaneval = "import math\n\ndef check(candidate):\n    assert candidate(2) == 3\n\ncheck(f)\n"
    suite = parse_test_suite(humaneval)
    assert suite.tests == ("check(f)",) and "def check(candidate)" in suite.setup
    lines = parse_test_suite("assert f(1) == 2\nassert (\n    f(2) == 3\n)\n")
    assert lines.tests == ("assert f(1) == 2", "assert f(2) == 3")
    for bad in ["", "x = 1", '{"tests": "assert ("}', '{"tests": [1]}', '{"test": []}', "if"]:
        with pytest.raises(ValueError):
            parse_test_suite(bad)


def sandboxed(solution: str, tests: tuple[str, ...] = ADD_TESTS, **limits: float) -> SandboxResult:
    settings = FAST.model_copy(update=limits)
    return run_tests(solution, tests, settings=settings)


def test_correct_code_scores_one_and_wrong_code_the_fraction_it_passes() -> None:
    right = sandboxed("def add(a, b):\n    return a + b\n")
    assert right.outcomes == ("pass",) * 3 and right.fraction == 1.0 and right.exit_code == 0
    wrong = sandboxed("def add(a, b):\n    return a * b if a == b else a + b + 1\n")
    assert wrong.outcomes == ("fail AssertionError", "fail AssertionError", "pass")
    assert wrong.fraction == pytest.approx(1 / 3)
    crash = sandboxed("def add(a, b):\n    return a + b if a > 0 else 1 / 0\n")
    assert crash.outcomes == ("pass", "fail ZeroDivisionError", "pass")


def test_code_that_does_not_run_scores_zero() -> None:
    for solution, error in [
        ("def add(a, b:\n    return a + b", "fail SyntaxError"),
        ("import numpy\ndef add(a, b):\n    return a + b", "fail ModuleNotFoundError"),
        ("raise SystemExit(0)", "fail SystemExit"),
    ]:
        result = sandboxed(solution)
        assert result.solution_error == error and result.fraction == 0.0
        assert result.outcomes == ("not run",) * 3


def test_an_infinite_loop_is_killed_at_the_timeout_keeping_earlier_results() -> None:
    tests = ("assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert True")
    busy = "def add(a, b):\n    while a == 0:\n        pass\n    return a + b\n"
    asleep = (
        "import time\ndef add(a, b):\n    if a == 0:\n        time.sleep(60)\n    return a + b\n"
    )
    for solution in (busy, asleep):
        result = sandboxed(solution, tests)
        # the first test ran before the loop: it was not cut short before the timeout
        assert result.outcomes == ("pass", "not run", "not run")
        assert result.exit_code in (-signal.SIGKILL, -signal.SIGXCPU)
        if solution is asleep:  # no CPU spent: the wall-clock timeout is what killed it
            assert result.timed_out and result.exit_code == -signal.SIGKILL
        else:  # the wall-clock timeout, or the CPU limit of the same seconds first
            assert result.timed_out or result.exit_code == -signal.SIGXCPU
    cut_short = sandboxed(busy, tests, timeout_s=0.5)
    assert cut_short.timed_out and cut_short.fraction == pytest.approx(1 / 3)


def test_a_memory_bomb_hits_the_memory_limit() -> None:
    # The wall clock gets room: with FAST's 1 s, a loaded machine (the suite's parallel
    # workers) killed the child before it filled 256 MiB (timed_out, SIGKILL, no test
    # run), and that is not what this test checks.
    result = sandboxed("hog = []\nwhile True:\n    hog.append(bytearray(2**20))\n", timeout_s=60.0)
    # the memory limit stopped it, neither the wall-clock timeout nor the CPU limit
    assert result.solution_error == "fail MemoryError" and not result.timed_out
    assert result.exit_code not in (-signal.SIGKILL, -signal.SIGXCPU)
    # The limit is what stops it: with more room, the same 64 MiB fits.
    fits = "hog = bytearray(64 * 2**20)\ndef add(a, b):\n    return a + b"
    assert sandboxed(fits, timeout_s=60.0).fraction == 1.0
    too_big = sandboxed("hog = bytearray(64 * 2**20)", memory_mb=48, timeout_s=60.0)
    assert too_big.solution_error == "fail MemoryError"


def test_huge_file_writes_stop_at_the_file_size_limit() -> None:
    write = (
        "def add(a, b):\n    return a + b\n"
        "with open('big', 'wb') as f:\n    f.write(bytes(2**20 + 1))\n"
    )
    assert sandboxed(write, file_size_mb=2).fraction == 1.0
    assert sandboxed(write, file_size_mb=1).solution_error == "fail OSError"  # EFBIG
    contained = (
        "import os",
        "try:\n    open('big', 'wb').write(bytes(4 * 2**20))\nexcept OSError:\n    pass",
        "assert os.path.getsize('big') <= 2**20",
    )
    assert sandboxed("", contained).outcomes == ("pass", "pass", "pass")


def seccomp_on() -> bool:
    return sandboxed("").seccomp


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter is x86-64 only")
def test_processes_threads_and_sockets_are_refused() -> None:
    assert seccomp_on(), "expected the seccomp filter on Linux x86-64"
    probes = {
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "subprocess": "import subprocess\nsubprocess.run(['true'])",
        "thread": "import threading\nthreading.Thread(target=print).start()",
        "socket": "import socket\nsocket.socket()",
        "signal": "import os\nos.kill(os.getppid(), 0)",
    }
    for name, solution in probes.items():
        result = sandboxed(solution)
        assert result.solution_error in ("fail PermissionError", "fail RuntimeError"), name
        assert not result.timed_out, name


def test_the_code_sees_no_secrets_no_input_and_a_fresh_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SF_TEST_SECRET", "hunter2")
    tests = (
        "import os\nassert 'SF_TEST_SECRET' not in os.environ",
        "import os\nassert set(os.environ) <= {'PATH', 'HOME', 'TMPDIR', 'LANG', 'LC_CTYPE'}",
        "import sys\nassert sys.stdin.read() == ''",
        "import os\nassert os.listdir('.') == [] and os.environ['HOME'] == os.getcwd()",
        "import importlib.util\nassert importlib.util.find_spec('pydantic') is None",
    )
    result = sandboxed("", tests)
    assert result.outcomes == ("pass",) * len(tests)


def test_exiting_early_or_forging_results_earns_nothing() -> None:
    forgeries = [
        "import sys\nsys.exit(0)",
        "import os\nos._exit(0)",
        "print('0 pass\\n1 pass\\n2 pass')",
        "import os\nfor fd in range(3, 1024):\n    try:\n        os.write(fd, b'x 0 pass\\n')\n"
        "    except OSError:\n        pass\nos._exit(0)",
        "class Fake(Exception):\n    pass\nFake.__name__ = 'x\\npass'\n"
        "def add(a, b):\n    raise Fake()",
        "import builtins\nbuiltins.exec = lambda *args: None\ndef add(a, b):\n    return None",
    ]
    for solution in forgeries:
        result = sandboxed(solution)
        assert result.passed == 0, solution


def test_output_is_captured_and_truncated() -> None:
    result = sandboxed("import sys\nprint('x' * 100_000)\nprint('oops', file=sys.stderr)")
    assert result.stdout == "x" * FAST.output_chars and result.stderr == "oops\n"


def test_code_tests_reward_reads_its_limits_and_never_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SF_REWARD_CODE_TIMEOUT_S", "0.5")
    reference = json.dumps({"tests": list(ADD_TESTS)})
    assert code_tests("```python\ndef add(a, b):\n    return a + b\n```", reference) == 1.0
    assert code_tests("def add(a, b):\n    return abs(a) + b", reference) == pytest.approx(2 / 3)
    timeouts: list[float] = []

    def feed_and_wait(process: Any, job: bytes, timeout_s: float) -> bool:
        timeouts.append(timeout_s)
        return real_feed_and_wait(process, job, timeout_s)

    real_feed_and_wait = sandbox.feed_and_wait
    monkeypatch.setattr(sandbox, "feed_and_wait", feed_and_wait)
    assert code_tests("```python\nwhile True: pass\n```", reference) == 0.0
    assert timeouts == [0.5]  # the env's 0.5 s, not the 10 s default
    garbage = ["", "```python\n", "\x00\x01", "\ud800", "```py\n" + "(" * 10_000 + "\n```",
               "x" * 2_000_000, "😀 ```python\nprint(1)```"]  # fmt: skip
    for completion in garbage:
        assert code_tests(completion, reference) == 0.0
    with pytest.raises(ValueError, match="no tests"):
        code_tests("def add(a, b):\n    return a + b", "import math")


def run_bpf(program: bytes, arch: int, nr: int) -> int:
    """A classic-BPF interpreter for the four instructions the filter uses."""
    instructions = [struct.unpack("HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data = struct.pack("iI", nr, arch)  # struct seccomp_data: nr, arch
    pc, accumulator = 0, 0
    while True:
        code, jump_true, jump_false, k = instructions[pc]
        if code == 0x20:
            accumulator = struct.unpack_from("I", data, k)[0]
        elif code in (0x15, 0x35):
            hit = accumulator == k if code == 0x15 else accumulator >= k
            pc += jump_true if hit else jump_false
        elif code == 0x06:
            return k
        pc += 1


def test_the_seccomp_filter_denies_exactly_its_list() -> None:
    program = seccomp_program(list(DENIED_SYSCALLS_X86_64.values()))
    x86_64, i386 = 0xC000003E, 0x40000003
    eperm = 0x00050000 | 1
    for nr in DENIED_SYSCALLS_X86_64.values():
        assert run_bpf(program, x86_64, nr) == eperm
    for nr in (0, 1, 2, 3, 9, 60, 231, 334):  # read, write, open, close, mmap, exit ...
        assert run_bpf(program, x86_64, nr) == 0x7FFF0000
    assert run_bpf(program, x86_64, 0x40000000 | 57) == eperm  # x32 ABI fork
    assert run_bpf(program, i386, 2) == 0x80000000  # 32-bit calls: killed
