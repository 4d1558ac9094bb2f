"""Task sources from local JSONL / Parquet files (``seamlessflow.tasks.files``) and the
example data in ``examples/``: real files, read through Hugging Face ``datasets``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from seamlessflow.plugins import UnknownPlugin
from seamlessflow.rewards import code_match, code_tests, get_reward, math_answer
from seamlessflow.tasks import TaskItem, get_task_source
from seamlessflow.tasks.files import TaskFileError, in_eval_split
from tests.support import REPO_ROOT

REPO = REPO_ROOT
EXAMPLES = REPO / "examples"


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def numbered_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"q{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(n)]


def test_jsonl_rows_become_tasks(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"prompt": "What is 1/2 + 1/4?", "answer": "3/4"},
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 6 * 7?"},
                ],
                "answer": 42,
            },
            {"prompt": "Write f.", "reference": {"tests": ["assert f() == 1"]}, "extra": 1},
        ],
    )
    source = get_task_source(f"{path}?reward=math_answer&eval_fraction=0")
    assert source.reward_fn == "math_answer" and get_reward(source.reward_fn) is math_answer
    assert source.items("eval") == []
    first, second, third = source.items("train")
    assert first.messages == ({"role": "user", "content": "What is 1/2 + 1/4?"},)
    assert first.reference == "3/4"
    assert second.messages[0] == {"role": "system", "content": "Be brief."}
    assert second.reference == "42"  # numbers are written as JSON text
    assert json.loads(third.reference) == {"tests": ["assert f() == 1"]}
    # Without an id column, the id is the file stem + a hash of prompt and reference.
    assert first.task_id.startswith("mixed-") and len({first.task_id, second.task_id}) == 2
    again = get_task_source(f"jsonl:{path}?reward=math_answer&eval_fraction=0")
    assert again.items("train") == source.items("train")


def test_splits_are_deterministic_disjoint_and_stable(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "q.jsonl", numbered_rows(400))
    name = f"{path}?reward=integer_match&eval_fraction=0.25"
    source = get_task_source(name, seed=0)
    train, evaluation = source.items("train"), source.items("eval")
    train_ids, eval_ids = {i.task_id for i in train}, {i.task_id for i in evaluation}
    assert not train_ids & eval_ids
    assert train_ids | eval_ids == {f"q{i}" for i in range(400)}
    assert 60 <= len(evaluation) <= 140  # a hash split: about a quarter
    assert all(in_eval_split(task_id, 0.25) for task_id in eval_ids)
    # The same rows whatever the seed, and appending rows moves no existing row.
    assert get_task_source(name, seed=7).items("eval") == evaluation
    write_jsonl(path, numbered_rows(500))
    grown = get_task_source(name)
    assert eval_ids <= {i.task_id for i in grown.items("eval")}
    assert train_ids <= {i.task_id for i in grown.items("train")}
    with pytest.raises(ValueError, match="split"):
        source.items("test")


def run_make_data(out: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(EXAMPLES / "make_data.py"), "--out", str(out), *args],
        check=True,
        timeout=60,
    )


def test_example_files_are_what_the_script_writes(tmp_path: Path) -> None:
    run_make_data(tmp_path)
    for name in ("math.jsonl", "code.jsonl"):
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), name


def test_parquet_source_matches_its_jsonl(tmp_path: Path) -> None:
    run_make_data(tmp_path, "--parquet")
    from_parquet = get_task_source(str(tmp_path / "math.parquet"))
    from_jsonl = get_task_source(str(EXAMPLES / "data" / "math.jsonl"))
    assert from_parquet.reward_fn == from_jsonl.reward_fn == "math_answer"  # its column
    for split in ("train", "eval"):
        assert from_parquet.items(split) == from_jsonl.items(split)
    assert len(from_jsonl.items("train")) + len(from_jsonl.items("eval")) == 36
    assert from_jsonl.items("eval")  # the default fraction holds some out
    forced = get_task_source(f"parquet:{tmp_path / 'math.parquet'}?reward=code_match")
    assert get_reward(forced.reward_fn) is code_match


def all_items(source_name: str) -> list[TaskItem]:
    source = get_task_source(source_name)
    return source.items("train") + source.items("eval")


def test_example_tasks_are_solved_by_their_references() -> None:
    """The data is consistent with its verifiers: the right answers score 1, wrong 0."""
    math_items = all_items(str(EXAMPLES / "data" / "math.jsonl"))
    assert all(math_answer(f"So \\boxed{{{i.reference}}}.", i.reference) == 1.0 for i in math_items)
    assert all(math_answer("So \\boxed{1000001}.", i.reference) == 0.0 for i in math_items)
    rows = [
        json.loads(line) for line in (EXAMPLES / "data" / "code.jsonl").read_text().splitlines()
    ]
    solutions = {row["id"]: row["solution"] for row in rows}
    code_items = all_items(str(EXAMPLES / "data" / "code.jsonl"))
    assert get_task_source(str(EXAMPLES / "data" / "code.jsonl")).reward_fn == "code_tests"
    assert len(code_items) == 12
    for item in code_items:
        assert item.messages[-1]["role"] == "user"
        answer = f"Here it is:\n```python\n{solutions[item.task_id]}```\n"
        assert code_tests(answer, item.reference) == 1.0, item.task_id
        assert code_tests("```python\ndef unrelated():\n    pass\n```", item.reference) == 0.0


def error_cases(tmp: Path) -> list[tuple[str, str]]:
    """(task name, expected error pattern) for files that cannot be used."""
    good = numbered_rows(3)
    cases = [
        (str(tmp / "missing.jsonl") + "?reward=math_answer", "missing.jsonl does not exist"),
        (str(tmp / "dir.jsonl") + "?reward=math_answer", "dir.jsonl is not a file"),
    ]
    (tmp / "dir.jsonl").mkdir()
    (tmp / "empty.jsonl").write_text("\n \n")
    cases.append((f"{tmp / 'empty.jsonl'}?reward=math_answer", "empty.jsonl is empty"))
    (tmp / "bad.jsonl").write_text('{"prompt": "a"\n')
    cases.append((f"{tmp / 'bad.jsonl'}?reward=math_answer", "bad.jsonl cannot be read as jsonl"))
    cases.append((f"parquet:{tmp / 'bad.jsonl'}?reward=math_answer", "cannot be read as parquet"))
    rows_by_name: dict[str, tuple[list[dict[str, Any]], str]] = {
        "noprompt": ([{"question": "a", "answer": "1"}], "noprompt.jsonl has no 'messages' or "
                     "'prompt' column \\(its columns: question, answer\\)"),
        "noref": ([{"prompt": "a", "solution": "1"}], "noref.jsonl has no 'reference' or "
                  "'answer' column"),
        "nullprompt": ([*good, {"prompt": None, "answer": "1"}], "nullprompt.jsonl, row 4: "
                       "no messages or prompt"),
        "emptyprompt": ([{"prompt": " ", "answer": "1"}], "row 1: column 'prompt' is empty"),
        "badmessage": ([{"messages": [{"role": "user"}], "answer": "1"}],
                       "row 1: column 'messages': each message needs a string 'role' and "
                       "'content'"),
        "assistantlast": ([{"messages": [{"role": "user", "content": "q"},
                                         {"role": "assistant", "content": "a"}],
                            "answer": "1"}], "ends with an assistant message"),
        "dupid": ([*good, {"id": "q1", "prompt": "b", "answer": "2"}],
                  "rows 2 and 4 have the same id 'q1'"),
        "tworewards": ([{"prompt": "a", "answer": "1", "reward_fn": "math_answer"},
                        {"prompt": "b", "answer": "2", "reward_fn": "integer_match"}],
                       "column 'reward_fn' names \\['integer_match', 'math_answer'\\]"),
    }  # fmt: skip
    for stem, (rows, pattern) in rows_by_name.items():
        path = write_jsonl(tmp / f"{stem}.jsonl", rows)
        cases.append((f"{path}?reward=math_answer" if stem != "tworewards" else str(path), pattern))
    plain = write_jsonl(tmp / "plain.jsonl", good)
    cases += [
        (str(plain), "plain.jsonl: which reward function scores it\\? Add \\?reward=NAME"),
        (f"{plain}?reward=no_such_reward", "plain.jsonl: reward 'no_such_reward'"),
        (f"{plain}?reward=no.such.module:fn", "reward 'no.such.module:fn'"),
        (f"{plain}?reward=math_answer&eval_fraction=1", "eval_fraction must be in \\[0, 1\\)"),
        (f"{plain}?reward=math_answer&eval_fraction=x", "eval_fraction must be in"),
        (f"{plain}?reward=math_answer&shuffle=1", "unknown options \\['shuffle'\\]"),
        (f"{plain}?reward", "cannot parse options"),
    ]
    return cases


def test_unusable_files_get_errors_naming_file_row_and_column(tmp_path: Path) -> None:
    for name, pattern in error_cases(tmp_path):
        with pytest.raises(TaskFileError, match=pattern):
            get_task_source(name)


def test_unknown_task_names_point_to_data_files() -> None:
    with pytest.raises(UnknownPlugin, match=r"arithmetic.*\.jsonl"):
        get_task_source("no-such-task")
    with pytest.raises(UnknownPlugin, match=r"no-such-task\.csv"):
        get_task_source("no-such-task.csv")


LOAD_OFFLINE = """
import os, socket, sys
def refuse(*args, **kwargs):
    raise AssertionError(f"network access: {args!r}")
socket.socket.connect = refuse
socket.getaddrinfo = refuse
from seamlessflow.tasks import get_task_source
for name in sys.argv[1:]:
    source = get_task_source(name)
    print(name, len(source.items("train")), len(source.items("eval")))
written = [os.path.join(d, f) for d, _, fs in os.walk(os.environ["HOME"]) for f in fs]
assert not written, written
"""


def test_loading_needs_no_network_and_writes_nothing_outside_tmp(tmp_path: Path) -> None:
    """In a fresh process (nothing imported yet), with the network refused and an empty
    home: datasets must neither connect nor leave a cache behind."""
    run_make_data(tmp_path / "data", "--parquet")
    home = tmp_path / "home"
    home.mkdir()
    names = [str(tmp_path / "data" / "math.parquet"), str(tmp_path / "data" / "code.jsonl")]
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", LOAD_OFFLINE, *names],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].endswith(" 31 5")
    assert not list(tmp_path.glob("sf-datasets-*"))  # the temporary cache is gone
