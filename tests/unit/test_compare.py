"""``seamlessflow compare``: runs side by side from what each run writes."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import msgspec
from typer.testing import CliRunner

from seamlessflow.protocol import TrainStepMetrics
from sf_app.cli import app
from sf_app.compare import generated_tokens_per_s, load_run, table
from sf_app.run.report import Summary


def write_run(runs: Path, run_id: str, mode: str, seconds_per_step: float) -> Path:
    """A run directory as the embedded run writes it: a summary and metrics lines."""
    run_dir = runs / run_id
    run_dir.mkdir(parents=True)
    steps = [
        TrainStepMetrics(
            step=step, version=step, batch_index=step - 1, mean_reward=step / 10,
            loss=0.1, clip_fraction=0.0, samples=8, tokens_generated=80 * step,
            tokens_trained=80 * step, max_staleness=0, step_seconds=1.0, wait_seconds=0.5,
            publish_seconds=0.1, policy="policy", timestamp=100.0 + seconds_per_step * step,
        )
        for step in range(1, 6)
    ]  # fmt: skip
    with (run_dir / "metrics.jsonl").open("w") as out:
        for metrics in steps:
            out.write(json.dumps(msgspec.to_builtins(metrics)) + "\n")
    summary = Summary(
        run_id=run_id, status="finished", steps=len(steps), reward_first=0.1, reward_last=0.5,
        tokens_generated=sum(m.tokens_generated for m in steps), tokens_trained=0,
        wall_s=60.0, final_version=5, mode=mode, generated_tokens_per_s=0.0,
        trained_tokens_per_s=0.0, mean_step_s=1.0, mean_wait_s=0.5, mean_publish_s=0.1,
        checkpoint=None, bubble_ratio=0.25 if mode == "disaggregated" else 0.125,
        steady_seconds_per_step=seconds_per_step, config={"policies": ["policy"]},
    )  # fmt: skip
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary)))
    return run_dir


def test_compare_tables_and_plots_several_runs(tmp_path: Path) -> None:
    slow = write_run(tmp_path, "slow", "disaggregated", 4.0)
    fast = write_run(tmp_path, "fast", "multiplexed", 2.0)
    records = [load_run(slow), load_run(fast)]
    lines = table(records).splitlines()
    assert lines[0].split()[:3] == ["run", "mode", "status"]
    assert lines[1].split()[:2] == ["slow", "disaggregated"] and "0.250" in lines[1]
    assert lines[2].split()[:2] == ["fast", "multiplexed"] and "0.125" in lines[2]
    # tokens since the previous step over the time between the two
    assert generated_tokens_per_s(records[1].steps)[0] == (2, 160 / 2.0)

    out = tmp_path / "compare.png"
    result = CliRunner().invoke(app, ["compare", str(slow), str(fast), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert result.output.splitlines()[:3] == lines
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_refuses_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["compare", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a run directory (no summary.json)" in result.output
