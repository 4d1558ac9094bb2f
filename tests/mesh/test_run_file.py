"""The run file (``seamlessflow.runfile``, ``sf_app.run.file``): one TOML description of a
run that the embedded run and each process started alone (``SF_CONFIG``) read alike; here
as processes read it: a service and the CLI stop with one line on a bad file, and a run
started from a file reports to both trackers. The reading in process is
tests/unit/test_run_file_reading.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from seamlessflow.bus import EXIT_UNRECOVERABLE
from tests.support.run_files import write_run_file


@pytest.mark.integration  # starts processes
def test_a_service_and_the_cli_stop_with_one_line_on_a_bad_run_file(tmp_path: Path) -> None:
    bad = write_run_file(tmp_path, "[trainer]\nlsos = 'grpo'\n")
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    service = subprocess.run(
        [sys.executable, "-m", "sf_trainer"],
        env={**env, "SF_CONFIG": str(bad)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert service.returncode == EXIT_UNRECOVERABLE, service.stderr
    [line] = service.stderr.strip().splitlines()
    assert line.startswith("trainer: run file ") and "did you mean 'loss'" in line
    cli = subprocess.run(
        [sys.executable, "-m", "sf_app", "up", "--config", str(bad), "--no-live"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert cli.returncode == 2, cli.stderr
    assert cli.stderr.strip().splitlines() == [line.removeprefix("trainer: ")]
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_a_run_started_from_a_file_reports_to_tensorboard_and_wandb(
    base_model_dir: Path, tmp_path: Path
) -> None:
    """The file sets the run and a service's own setting ([trainer] eval_*), the command
    line overrides one key (--steps), and both trackers get every step."""
    import json
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.support.wandb_records import logged

    run_file = write_run_file(
        tmp_path,
        """
[run]
steps = 50                 # overridden on the command line
group_size = 4
groups_per_batch = 2
agent_concurrency = 8
engine_batch_size = 8
report_to = ["tensorboard", "wandb"]
eval_every = 2

[trainer]
eval_items = 4
""",
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    env |= {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    command = [
        sys.executable, "-m", "sf_app", "up", "--config", str(run_file), "--steps", "2",
        "--no-live", "--model-dir", str(base_model_dir), "--runs-dir", str(tmp_path / "runs"),
        "--run-id", "from-file",
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    run_dir = tmp_path / "runs" / "from-file"
    assert result.returncode == 0, result.stderr[-3000:]
    assert (run_dir / "run-file.toml").read_text() == run_file.read_text()
    # the resolved file every process read: the command line's steps, the file's rest
    resolved = tomllib.loads((run_dir / "run.toml").read_text())
    assert (resolved["run"]["steps"], resolved["trainer"]["steps"]) == (2, 2)
    assert (resolved["trainer"]["eval_items"], resolved["trainer"]["eval_every"]) == (4, 2)
    config = json.loads((run_dir / "summary.json").read_text())["config"]
    assert (config["steps"], config["group_size"], config["report_to"]) == (
        2, 4, ["tensorboard", "wandb"],
    )  # fmt: skip
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if line["type"] == "train.metrics"]
    evals = [line for line in lines if line["type"] == "train.eval"]
    assert [m["step"] for m in steps] == [1, 2]
    # [run] eval_every and [trainer] eval_items reached the trainer: the base model, step 2
    assert [(e["step"], e["samples"]) for e in evals] == [(0, 4), (2, 4)]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    curve = [(e.step, e.value) for e in events.Scalars("train/mean_reward")]
    assert [step for step, _ in curve] == [1, 2]
    for (_, value), step in zip(curve, steps, strict=True):
        assert value == pytest.approx(step["mean_reward"], rel=1e-6, abs=1e-7)  # float32
    assert [e.value for e in events.Scalars("eval/samples")] == [4.0, 4.0]

    history = [row for row in logged(run_dir)["history"] if "train/step" in row]
    assert [row["train/step"] for row in history] == [1, 2]
    assert [row["train/mean_reward"] for row in history] == [m["mean_reward"] for m in steps]
