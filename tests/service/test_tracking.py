"""Experiment tracking (``sf_app.tracking``) with other processes: a W&B offline run
(wandb starts its ``wandb-core`` service process) holds the curves, config and summary,
read back from its transaction log, and ``seamlessflow track`` follows a deployed run's
stream on a real nats-server. The in-process parts (``--report-to``, derived figures,
TensorBoard's event files) are tests/unit/test_tracking_backends.py."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from seamlessflow.bus import Bus
from seamlessflow.protocol import TrainingFinished
from sf_app.tracking import Tracker
from tests.support.tracking_steps import POLICIES, run_steps, step_metrics
from tests.support.wandb_records import logged


@pytest.mark.integration  # wandb's own service process (wandb-core)
def test_a_wandb_offline_run_holds_the_curves_config_and_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"steps": 2, "policies": POLICIES}
    with Tracker(
        ["wandb"], run_dir=tmp_path, run_id="r2", policies=POLICIES, config=config
    ) as tracker:
        sent = run_steps(tracker, 2)
        tracker.finish({"bubble_ratio": 0.25, "reclaims": 3}, tmp_path)

    run = logged(tmp_path)
    for policy in POLICIES:
        rows = [row for row in run["history"] if f"{policy}/step" in row]
        expected = [m for m in sent if m.policy == policy]
        assert [row[f"{policy}/step"] for row in rows] == [m.step for m in expected]
        assert [row[f"{policy}/mean_reward"] for row in rows] == [m.mean_reward for m in expected]
        assert all(f"{policy}/lr" in row for row in rows)
    assert run["summary"]["summary/bubble_ratio"] == 0.25
    assert run["summary"]["summary/reclaims"] == 3
    assert run["config"]["steps"] == 2 and run["config"]["policies"] == POLICIES


@pytest.mark.integration  # a real nats-server, a real `seamlessflow track` process
async def test_track_follows_a_deployed_runs_stream_until_every_policy_finished(
    bus: Bus, nats_url: str, run_id: str, tmp_path: Path
) -> None:
    """What the trainers published before `track` started is replayed, steps of a
    policy the run does not name are skipped, and it stops once both finished."""
    import asyncio
    import os
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sent = []
    for step in (1, 2, 3):
        for policy in (*POLICIES, "stranger"):
            metrics = step_metrics(policy if policy in POLICIES else "solver", step, 0.0)
            metrics = msgspec.structs.replace(metrics, policy=policy)
            await bus.js_publish(bus.subjects.for_policy(policy).train_metrics(), metrics)
            if policy in POLICIES:
                sent.append(metrics)
    for policy in POLICIES:
        finish = TrainingFinished(steps=3, final_version=3, checkpoint_dir="", policy=policy)
        await bus.js_publish(bus.subjects.for_policy(policy).train_finished(), finish)

    env = {k: v for k, v in os.environ.items() if not k.startswith("SF_")}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "sf_app", "track", "--report-to", "tensorboard",
        "--run-id", run_id, "--nats-url", nats_url, "--policies", ",".join(POLICIES),
        "--out-dir", str(tmp_path),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, err.decode()[-2000:]
    assert f"tracked {len(sent)} steps of run {run_id}" in out.decode()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    for policy in POLICIES:
        series = [e.step for e in events.Scalars(f"{policy}/mean_reward")]
        assert series == [1, 2, 3]
    assert not any(tag.startswith("stranger/") for tag in events.Tags()["scalars"])
