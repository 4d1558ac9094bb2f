"""The judge service of the peer comparison (loadtests/peer_judge.py), as a real server:
both frameworks' clients get the task's reward from it, after latencies drawn from one
seeded sequence, and a bad request gets a 400."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from seamlessflow.rewards import integer_match
from tests.support import LOADTESTS, load_loadtest

pytestmark = pytest.mark.integration  # the judge server is a process of its own


@pytest.fixture
def judge(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    command = [sys.executable, str(LOADTESTS / "peer_judge.py"), "--median-ms", "20"]
    with subprocess.Popen([*command, "--seed", "3"], stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        url = process.stdout.readline().strip()
        monkeypatch.setenv("PEER_JUDGE_URL", url)
        yield url
        process.terminate()


CASES = [("The answer is 12", "12"), ("13", "12"), ("no number", "7"), ("-4\n", "-4")]


def test_both_clients_get_the_tasks_reward_after_the_same_latencies(judge: str) -> None:
    peer_judge = load_loadtest("peer_judge")
    expected = [float(integer_match(c, r)) for c, r in CASES]
    assert sorted(set(expected)) == [0.0, 1.0]  # the cases tell right from wrong

    ours = [peer_judge.judged_integer_match(c, r) for c, r in CASES]
    first = peer_judge.stats(judge)
    peer_judge.reset(judge)
    completions = [[{"role": "assistant", "content": c}] for c, _ in CASES]
    theirs = asyncio.run(peer_judge.trl_judge_reward(completions, [r for _, r in CASES]))
    second = peer_judge.stats(judge)

    assert ours == expected and theirs == expected
    assert first["requests"] == second["requests"] == len(CASES)
    # one seeded sequence per reset: the same latencies whatever the client or the order
    assert first == second and first["max_s"] > 0


def test_a_bad_judge_request_gets_a_400(judge: str) -> None:
    request = urllib.request.Request(f"{judge}/judge", data=b'{"completion": 1}')
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 400
    assert "bad judge request" in json.loads(refused.value.read())["error"]
    peer_judge = load_loadtest("peer_judge")
    assert peer_judge.stats(judge) == {"requests": 0}  # nothing drawn for it
