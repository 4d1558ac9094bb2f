"""The weight-sync benchmark (loadtests/weight_sync.py) runs end to end with tiny settings."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from seamlessflow.weights.settings import WeightTransferSettings
from tests.support import REPO_ROOT

SCRIPT = REPO_ROOT / "loadtests" / "weight_sync.py"


def test_the_weight_sync_benchmark_runs_and_writes_its_figures(
    tmp_path: Path, base_model_dir: Path
) -> None:
    out = tmp_path / "weight_sync.json"
    command = [sys.executable, str(SCRIPT), "--quick", "--sizes", "10", "--repeats", "1"]
    command += ["--steps", "2", "--model-dir", str(base_model_dir), "--json", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr

    report = json.loads(out.read_text())
    [size] = report["sizes"]
    assert size["megabytes"] == 10 and 9_000_000 < size["state_bytes"] <= 10_000_000
    for bound in ("memcpy", "loopback_tcp", "xxh3_128", "sha256"):
        assert size["bounds"][bound]["MBps"] > 0, bound
    # the ring row where /dev/shm has room for the ring (four buckets and a page)
    ring_bytes = 4 * WeightTransferSettings().bucket_bytes + 4096
    ring = {"ring"} if shutil.disk_usage("/dev/shm").free > ring_bytes else set()
    assert set(size["transports"]) == {"shm", "object", "collective", "streamed"} | ring
    for name, figures in size["transports"].items():
        assert figures["seconds"] > 0 and figures["MBps"] > 0, name
        assert figures["sync_to_bound"] > 0, name
        assert all(seconds >= 0 for seconds in figures["parts_seconds"].values()), name

    deltas = report["deltas"]
    assert deltas["parameters"] > 0
    assert [run["lr"] for run in deltas["runs"]] == [1e-4, 1e-6]
    for run in deltas["runs"]:
        assert [record["step"] for record in run["steps"]] == [1, 2]
        for record in run["steps"]:
            for dtype in ("float32", "bfloat16"):
                version = record[dtype]
                assert version["kind"] in ("full", "delta")
                assert 0 < version["payload_bytes"] <= version["state_bytes"]
                assert 0 <= version["changed_fraction"] <= 1
        assert run["saved"]["bfloat16"]["state_bytes"] > 0
    # at lr 1e-6 few bf16 words change: the deltas are much smaller than the state
    assert deltas["runs"][1]["saved"]["bfloat16"]["saved_fraction"] > 0.5
