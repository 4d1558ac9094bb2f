"""Experiment tracking (``sf_app.tracking``) in process: ``--report-to``'s names, the
figures derived from a step and the one before, TensorBoard's event files read back with
its own reader (every series per policy, a single policy's under ``train``), and a
failing backend dropped while the others go on. A W&B offline run and ``seamlessflow
track`` following a deployed run are tests/service/test_tracking.py."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import pytest

from seamlessflow.protocol import TrainEvalMetrics
from sf_app.tracking import ReportToError, Tracker, parse_report_to, step_values
from tests.support.tracking_steps import POLICIES, run_steps, step_metrics

matplotlib.use("Agg")


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
