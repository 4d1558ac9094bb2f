"""The load tests run end to end with tiny settings: the gateway load test
(loadtests/gateway_load.py) with the real model and the agents in the services' event
loop, with the scripted engine and the agents in two separate load-generator processes,
and with gateway processes on one port; the broker load (loadtests/broker_load.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO_ROOT, load_loadtest

SCRIPT = REPO_ROOT / "loadtests" / "gateway_load.py"


@pytest.mark.parametrize(
    ("backend", "client_processes", "sessions"),
    [("hf", 0, [2]), ("scripted", 2, [1, 4])],  # 1 < 2 processes: one stays idle
    ids=["hf-in-process", "scripted-2-client-processes"],
)
def test_the_gateway_load_test_runs_and_writes_its_figures(
    tmp_path: Path, base_model_dir: Path, backend: str, client_processes: int, sessions: list[int]
) -> None:
    out = tmp_path / "load.json"
    command = [sys.executable, str(SCRIPT), "--sessions", ",".join(map(str, sessions))]
    command += ["--turns", "2", "--duration", "2", "--engine-backend", backend]
    command += ["--client-processes", str(client_processes)]
    command += ["--model-dir", str(base_model_dir), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout

    report = json.loads(out.read_text())
    assert report["ok"] is True and report["interrupted"] is False
    machine = report["machine"]
    assert {"cpu_count", "platform", "python", "torch", "rlimit_nofile"} <= machine.keys()
    assert machine["cpu_count"] >= 1
    settings = report["settings"]
    assert settings["engine_backend"] == backend
    assert settings["client_processes"] == client_processes
    assert [level["sessions"] for level in report["levels"]] == sessions
    for level in report["levels"]:
        assert level["turns"] == 2
        assert level["requests_per_s"] > 0 and level["chat_requests"] >= 2 * level["sessions"]
        assert level["chat_requests"] == 2 * level["sessions_completed"]
        assert {"p50", "p99"} <= level["latency_ms"].keys()
        assert level["latency_ms"]["p50"] > 0
        assert level["direct"]["requests_per_s"] > 0
        # the direct phase replays the gateway's requests within the same --duration:
        # all of them on an idle machine, fewer when the CPU is shared (never more)
        direct = level["direct"]["requests"]
        assert 0 < direct <= level["chat_requests"]
        if backend == "scripted":  # (a model's batch mates may flip a near-tie token)
            # same prompt, seed and budget straight to the engine: the same tokens
            assert level["direct"]["same_tokens_as_gateway"] == direct
        assert {"p50", "p99"} <= level["gateway_added_ms"].keys()
        assert level["verified"] is True and level["mismatches"] == []
        assert level["errors"] == 0
        assert level["cpu_s"]["services"] > 0
        if client_processes:
            assert level["cpu_s"]["clients"] > 0
    final = report["final_check"]
    assert final["verified"] is True
    # the warm-up (one session per load generator) and every level's sessions
    assert final["sessions"] == max(client_processes, 1) + sum(
        level["sessions_completed"] for level in report["levels"]
    )


def test_gateway_processes_on_one_port_are_measured_per_count(
    tmp_path: Path, base_model_dir: Path
) -> None:
    """``--gateway-processes 1,2 --trajectory``: one run per count, the gateways' own CPU
    counted, every turn stored once whichever process took it, and the trajectory service
    (its own process) applied the levels' sessions."""
    out = tmp_path / "load.json"
    command = [sys.executable, str(SCRIPT), "--sessions", "4", "--turns", "2", "--duration", "2"]
    command += ["--gateway-processes", "1,2", "--engine-backend", "scripted", "--trajectory"]
    command += ["--model-dir", str(base_model_dir), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gateway processes | sessions" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert [run["settings"]["gateway_processes"] for run in report["runs"]] == [1, 2]
    for run in report["runs"]:
        [level] = run["levels"]
        assert level["gateway_processes"] == run["settings"]["gateway_processes"]
        assert level["verified"] is True and level["errors"] == 0
        assert level["cpu_s"]["gateways"] > 0  # the gateway processes' own CPU
        # the trajectory service read the stream meanwhile and applied every session
        assert level["cpu_s"]["trajectory"] > 0
        assert level["trajectory_lag_s"] is not None and level["trajectory_lag_s"] >= 0
        assert level["chat_requests"] == 2 * level["sessions_completed"] > 0


@pytest.mark.integration  # its own nats-server and an embedded run's processes
def test_the_broker_load_counts_messages_and_bytes_per_turn_and_step(tmp_path: Path) -> None:
    """loadtests/broker_load.py: one step of the single-turn workload against its own
    server; what it reports adds up (the turns are the run's, the weights went through
    the object store)."""
    broker_load = load_loadtest("broker_load")
    out = tmp_path / "broker.json"
    code = broker_load.main(
        [
            "--steps",
            "1",
            "--workloads",
            "single-turn",
            "--runs-dir",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    [result] = json.loads(out.read_text())
    assert result["steps"] == 1 and result["turns"] >= result["samples"] > 0
    assert result["broker"]["in_msgs"] >= 10 * result["turns"]  # request, reply, record, acks
    assert result["per_turn"]["in_bytes"] * result["turns"] == pytest.approx(
        result["broker"]["in_bytes"], rel=0.01
    )
    stored = result["stored"]
    assert any(name.startswith("OBJ_") and s["bytes"] > 0 for name, s in stored.items())
    assert any(
        name.endswith("_TRAJ") and s["messages"] >= 3 * result["samples"]
        for name, s in stored.items()
    )
