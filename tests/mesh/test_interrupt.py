"""Ctrl-C on `seamlessflow up` stops every process and still writes the run report."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow


async def test_ctrl_c_stops_everything_and_writes_what_it_has(
    base_model_dir: Path, tmp_path: Path
) -> None:
    command = [
        sys.executable,
        "-m",
        "sf_app",
        "up",
        "--steps",
        "10000",
        "--no-live",
        "--model-dir",
        str(base_model_dir),
        "--runs-dir",
        str(tmp_path),
        "--run-id",
        "interrupted",
        "--group-size",
        "2",
        "--groups-per-batch",
        "2",
    ]
    with (tmp_path / "up.log").open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *command, stdout=log, stderr=subprocess.STDOUT
        )
    run_dir = tmp_path / "interrupted"
    metrics = run_dir / "metrics.jsonl"
    try:
        async with asyncio.timeout(180):
            while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
                assert process.returncode is None, (tmp_path / "up.log").read_text()[-2000:]
                await asyncio.sleep(0.5)
        process.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(process.wait(), 90)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert code == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert summary["steps"] >= 2 and summary["final_version"] == summary["steps"]
    # the trainer saved its latest policy on the way out
    state = json.loads((run_dir / "checkpoints" / "final" / "trainer_state.json").read_text())
    assert state["version"] >= summary["final_version"]
    AutoModelForCausalLM.from_pretrained(str(run_dir / "checkpoints" / "final"))
    # and every service process exited cleanly (no stack traces on the way out)
    for log in (run_dir / "logs").glob("*.log"):
        assert "Traceback" not in log.read_text(), log.name
