"""Experiment tracking (``sf_app.tracking``): what a run logs reaches TensorBoard's event
files and a W&B offline run, read back with each tool's own reader."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import msgspec
import pytest

from seamlessflow.bus import Bus
from seamlessflow.protocol import TrainEvalMetrics, TrainingFinished, TrainStepMetrics
from sf_app.tracking import ReportToError, Tracker, parse_report_to, step_values
from tests.support.wandb_records import logged

matplotlib.use("Agg")

POLICIES = ["solver", "verifier"]


def step_metrics(policy: str, step: int, start: float) -> TrainStepMetrics:
    """A step whose figures differ per policy and step (so a mix-up shows)."""
    scale = 1 + POLICIES.index(policy)
    return TrainStepMetrics(
        step=step,
        version=step,
        batch_index=step - 1,
        mean_reward=0.1 * step * scale,
        loss=0.5 / step,
        clip_fraction=0.01 * step,
        samples=16,
        tokens_generated=100 * step * scale,
        tokens_trained=90 * step * scale,
        max_staleness=1,
        step_seconds=2.0 * scale,
        wait_seconds=1.0,
        publish_seconds=0.5,
        lr=1e-4 * step,
        policy=policy,
        timestamp=start + 10.0 * step,
    )


def run_steps(tracker: Tracker, steps: int) -> list[TrainStepMetrics]:
    logged_steps = []
    for step in range(1, steps + 1):
        for policy in POLICIES:
            metrics = step_metrics(policy, step, start=1000.0)
            tracker.step(metrics)
            logged_steps.append(metrics)
    return logged_steps


def a_png(path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1], [0, 1])
    fig.savefig(path, dpi=40)
    plt.close(fig)
    return path


def test_report_to_takes_trls_names() -> None:
    assert parse_report_to("none") == ()
    assert parse_report_to("") == ()
    assert parse_report_to("tensorboard, wandb,tensorboard") == ("tensorboard", "wandb")
    assert parse_report_to(["wandb"]) == ("wandb",)
    assert set(parse_report_to("all")) == {"tensorboard", "wandb"}  # both installed (dev)
    with pytest.raises(ReportToError, match="unknown --report-to 'mlflow'; known: none, all"):
        parse_report_to("tensorboard,mlflow")


def test_derived_figures_come_from_the_step_and_the_one_before() -> None:
    first = step_metrics("solver", 1, start=0.0)
    second = step_metrics("solver", 2, start=0.0)
    assert "generated_tokens_per_s" not in step_values(first, None)
    values = step_values(second, first.timestamp)
    interval = second.timestamp - first.timestamp
    assert values["generated_tokens_per_s"] == second.tokens_generated / interval
    assert values["trained_tokens_per_s"] == second.tokens_trained / second.step_seconds
    total = second.wait_seconds + second.step_seconds + second.publish_seconds
    assert values["trainer_idle_fraction"] == second.wait_seconds / total
    assert values["mean_reward"] == second.mean_reward and "policy" not in values


def test_tensorboard_event_files_hold_every_series_per_policy(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {"steps": 3, "mode": "multiplexed"}
    with Tracker(
        ["tensorboard"], run_dir=tmp_path, run_id="r1", policies=POLICIES, config=config
    ) as tracker:
        sent = run_steps(tracker, 3)
        tracker.evaluation(
            TrainEvalMetrics(
                step=3, version=3, task="arithmetic", split="eval", samples=32,
                mean_reward=0.75, max_tokens=6, eval_seconds=4.0, policy="solver",
            )
        )  # fmt: skip
        a_png(tmp_path / "reward_curve.png")
        tracker.finish({"bubble_ratio": 0.125, "lends": 4, "status": "finished"}, tmp_path)

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for policy in POLICIES:
        series = [(e.step, e.value) for e in events.Scalars(f"{policy}/mean_reward")]
        expected = [(m.step, m.mean_reward) for m in sent if m.policy == policy]
        assert [s for s, _ in series] == [s for s, _ in expected]
        # event files store float32
        assert all(
            math.isclose(v, e, rel_tol=1e-6)
            for (_, v), (_, e) in zip(series, expected, strict=True)
        )
        assert {f"{policy}/lr", f"{policy}/trainer_idle_fraction"} <= scalars
        assert f"{policy}/generated_tokens_per_s" in scalars
    assert [e.value for e in events.Scalars("solver/eval/mean_reward")] == [0.75]
    assert math.isclose(events.Scalars("summary/bubble_ratio")[0].value, 0.125)
    assert "summary/status" not in scalars  # not a figure
    assert events.Tags()["images"] == ["figures/reward_curve"]
    assert "config" in "".join(events.Tags()["tensors"])


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


def test_a_single_policy_run_logs_under_train(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Tracker(
        ["tensorboard"], run_dir=tmp_path, run_id="r3", policies=["policy"], config={}
    ) as tracker:
        tracker.step(step_metrics("solver", 1, 0.0))
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "train/mean_reward" in events.Tags()["scalars"]


def test_a_failing_backend_is_dropped_and_the_others_go_on(tmp_path: Path) -> None:
    with Tracker(
        ["tensorboard"], run_dir=tmp_path, run_id="r4", policies=["policy"], config={}
    ) as tracker:

        class Broken:
            def log(self, *args: object) -> None:
                raise OSError("disk full")

            def close(self) -> None:
                pass

        tracker.backends["broken"] = Broken()  # type: ignore[assignment]
        tracker.step(step_metrics("solver", 1, 0.0))
        assert list(tracker.backends) == ["tensorboard"]


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
