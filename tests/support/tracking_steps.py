"""Training steps for the tests of experiment tracking (``sf_app.tracking``): two
policies' ``TrainStepMetrics`` whose figures differ per policy and step, and a
``Tracker`` fed a few steps of each."""

from __future__ import annotations

from seamlessflow.protocol import TrainStepMetrics
from sf_app.tracking import Tracker

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
