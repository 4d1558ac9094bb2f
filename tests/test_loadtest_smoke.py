"""The gateway load test (loadtests/gateway_load.py) runs end to end with tiny settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "loadtests" / "gateway_load.py"


def test_the_gateway_load_test_runs_and_writes_its_figures(
    tmp_path: Path, base_model_dir: Path
) -> None:
    out = tmp_path / "load.json"
    command = [sys.executable, str(SCRIPT), "--sessions", "2", "--turns", "2", "--duration", "2"]
    command += ["--model-dir", str(base_model_dir), "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout

    report = json.loads(out.read_text())
    assert report["ok"] is True and report["interrupted"] is False
    machine = report["machine"]
    assert {"cpu_count", "platform", "python", "torch"} <= machine.keys()
    assert machine["cpu_count"] >= 1
    [level] = report["levels"]
    assert level["sessions"] == 2 and level["turns"] == 2
    assert level["requests_per_s"] > 0 and level["chat_requests"] >= 2
    assert level["chat_requests"] == 2 * level["sessions_completed"]
    assert {"p50", "p99"} <= level["latency_ms"].keys()
    assert level["latency_ms"]["p50"] > 0
    assert level["direct"]["requests_per_s"] > 0
    assert level["direct"]["requests"] == level["chat_requests"]
    assert {"p50", "p99"} <= level["gateway_added_ms"].keys()
    assert level["verified"] is True and level["mismatches"] == []
    assert level["errors"] == 0
