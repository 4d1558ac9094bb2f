"""What an embedded run shows: live progress while it runs, the report when it ends.

runs/<run-id>/summary.json      the contract: see ``Summary``
runs/<run-id>/metrics.jsonl     written as the metrics arrive (``sf_app.run.embedded``)
runs/<run-id>/spans.jsonl       every process's spans, merged from spans/
runs/<run-id>/reward_curve.png
runs/<run-id>/timeline.html|png one lane per resource, bubbles marked
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from seamlessflow.machine import PrecisionChoice
from seamlessflow.protocol import (
    BatchFilterReport,
    EpochFilterReport,
    TrainEvalMetrics,
    TrainingFinished,
    TrainStepMetrics,
)
from seamlessflow.settings import checkpoints_dir
from sf_app.run.config import RunConfig

log = logging.getLogger(__name__)


@dataclass
class RunState:
    """What the run has seen so far: read by the live display and by the report."""

    config: RunConfig
    run_id: str
    run_dir: Path
    metrics_by_policy: dict[str, list[TrainStepMetrics]]
    finished_by_policy: dict[str, TrainingFinished] = field(default_factory=dict)
    evals_by_policy: dict[str, list[TrainEvalMetrics]] = field(default_factory=dict)
    """Held-out evaluations by policy, in the order they arrived."""
    status: str = "running"
    """running, then finished | interrupted | failed: <the one line why>."""
    restarts: dict[str, int] = field(default_factory=dict)
    """The supervisor's restart counts (the same dict)."""
    process_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    """The supervisor's samples of each process's resident memory (the same dict;
    ``sf_app.run.memory``)."""
    precision: PrecisionChoice | None = None
    """The trainer's precision as the run resolved it (``--precision``, ``auto``)."""
    mode_choice: dict[str, str] = field(default_factory=dict)
    """``--mode`` as the run laid it out (``sf_app.run.config.ModeChoice.record``)."""
    hardware: dict[str, Any] = field(default_factory=dict)
    epochs: list[EpochFilterReport] = field(default_factory=list)
    """The trajectory's epoch records (``data.epoch``), read when the run finished."""
    batch_reports: list[BatchFilterReport] = field(default_factory=list)
    """The first policy's batch filter reports (``data.<policy>.batch``), likewise."""
    started: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)

    @property
    def metrics(self) -> list[TrainStepMetrics]:
        """The first policy's steps (the only policy of a single-policy run)."""
        return self.metrics_by_policy[self.config.policies[0]]

    @property
    def finished(self) -> TrainingFinished | None:
        return self.finished_by_policy.get(self.config.policies[0])

    @property
    def multi_policy(self) -> bool:
        return len(self.config.policies) > 1


@dataclass
class Summary:
    """``summary.json``: read by tools and users. Field names are a contract."""

    run_id: str
    status: str
    steps: int
    reward_first: float | None
    reward_last: float | None
    tokens_generated: int
    tokens_trained: int
    wall_s: float
    final_version: int
    mode: str
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    mean_step_s: float
    mean_wait_s: float
    mean_publish_s: float
    checkpoint: str | None
    bubble_ratio: float | None = None
    """Idle slot-time / total over the busy window (``sf_app.timeline``)."""
    steady_generated_tokens_per_s: float = 0.0
    """Generated tokens/s between the first and the last step (start-up excluded): the
    figure to compare modes by."""
    steady_seconds_per_step: float = 0.0
    """Mean time between consecutive steps (start-up excluded): with a fixed number of
    steps, the figure that does not depend on how long the answers were."""
    mode_choice: dict[str, str] = field(default_factory=dict)
    """``--mode`` as laid out: ``requested``, ``layout`` (the deployment: ``auto`` is
    laid out ``multiplexed`` where slots are real, else ``disaggregated``), ``reason``."""
    lending_switches: list[dict[str, Any]] = field(default_factory=list)
    """``auto``: each change of the measured lending choice (its first one too), from
    the tag-scheduler's ``sched.decide`` spans: ``policy``, ``version`` (the trainer's
    version at that wait), ``before``/``after`` (shares of the lendable engines lent;
    ``before`` None for the first), ``why`` (the measured step periods)."""
    lends: int = 0
    """Engines lent to rollout from training slots (``sched.lend`` spans)."""
    reclaims: int = 0
    """Engines taken back for training (``sched.reclaim`` spans)."""
    requests_handed_back: int = 0
    """Requests in flight on reclaimed engines, resumed elsewhere (partial rollout)."""
    lent_thread_seconds: float = 0.0
    """Thread-seconds the trainer ran on cores lent by idle rollout engines (lending in
    the other direction, ``CoresLent``), over the run."""
    phase_seconds: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per resource, seconds in each phase and its mean ``sync`` interval
    (``phase_seconds``): where each engine's and the trainer's time went."""
    weights_bytes_sent: int = 0
    """Weight payload bytes over the run (per engine): fulls plus deltas."""
    weights_bytes_full: int = 0
    """What sending every version in full would have cost (``SF_WEIGHTS_DELTAS``)."""
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per policy: steps, reward_first, reward_last, final_version, tokens_trained,
    checkpoint. The fields above describe the first policy (the tasks' policy)."""
    eval_first: dict[str, Any] | None = None
    """The first held-out evaluation (``eval_every``: the base model, step 0):
    ``step, version, mean_reward`` (the accuracy for a 0/1 scorer), ``samples``, ``task``."""
    eval_last: dict[str, Any] | None = None
    """The last held-out evaluation (after the last step), as ``eval_first``."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Supervision: how many times each process (by label; ``nats`` for the embedded
    server) was started again after an unexpected exit."""
    process_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per process (by label, ``nats`` too): ``peak_rss_bytes`` (the kernel's high-water
    mark of its resident memory), ``tree_peak_rss_bytes`` (the largest sampled sum with
    its descendants': vLLM's engine core) and ``samples``, sampled every 2 s while the
    run goes on (``sf_app.run.memory``; Linux only, else empty)."""
    config: dict[str, Any] = field(default_factory=dict)
    precision: dict[str, str] = field(default_factory=dict)
    """What the trainer computed in and why: ``requested`` (``auto`` unless given),
    ``chosen`` (``fp32`` | ``bf16-mixed``), ``reason`` (what the hardware does)."""
    hardware: dict[str, Any] = field(default_factory=dict)
    """The machine the run chose its defaults on: ``cpu_isa``, ``cpu_bf16``, ``cores``."""
    data_filters: dict[str, Any] = field(default_factory=dict)
    """What the data algorithms did (``SF_TRAJECTORY_DATA_FILTERS``): ``groups_kept``,
    ``groups_dropped`` and ``samples_dropped`` by reason over the batches, and ``epochs``,
    one per epoch of each stage: ``stage``, ``epoch``, ``prompts`` dispatched, and of the
    previous epoch's prompts those ``kept`` and ``dropped``, by reason (history
    resampling: ``all_correct`` dropped; ``mixed``, ``all_wrong``, ``unseen`` kept)."""


def window_mean(values: list[float], first: bool) -> float | None:
    """Mean over the first or last 10% of the values (at least one)."""
    if not values:
        return None
    n = max(1, len(values) // 10)
    chosen = values[:n] if first else values[-n:]
    return sum(chosen) / len(chosen)


def merge_spans(run_dir: Path) -> Path:
    """``run_dir/spans.jsonl`` rewritten from every process's ``spans/*.jsonl`` (where
    they are; a run directory holding only a merged file is left as it is)."""
    merged_path = run_dir / "spans.jsonl"
    parts = sorted((run_dir / "spans").glob("*.jsonl"))
    if parts or not merged_path.exists():
        with merged_path.open("wb") as merged:
            for part in parts:
                merged.write(part.read_bytes())
    return merged_path


def write_report(state: RunState) -> Summary:
    """Merge the spans, then write ``summary.json`` and the reward curve; the timeline
    (``sf_app.timeline``) gives the bubble ratio."""
    run_dir = state.run_dir
    merge_spans(run_dir)
    bubble_ratio = None
    if (run_dir / "spans.jsonl").stat().st_size:
        from sf_app.timeline import render_run

        bubble_ratio = round(render_run(run_dir).bubble_ratio, 4)
    scheduling = read_scheduling(run_dir / "spans.jsonl")
    metrics = state.metrics
    evals = sorted(state.evals_by_policy.get(state.config.policies[0], []), key=lambda e: e.step)
    steady_window = metrics[-1].timestamp - metrics[0].timestamp if metrics else 0
    steady_tokens = sum(m.tokens_generated for m in metrics[1:])
    rewards = [m.mean_reward for m in metrics]
    train_wall = (metrics[-1].timestamp - state.started_wall) if metrics else 0.0
    generated = sum(m.tokens_generated for m in metrics)
    trained = sum(m.tokens_trained for m in metrics)
    n = max(len(metrics), 1)
    summary = Summary(
        run_id=state.run_id,
        status=state.status,
        steps=len(metrics),
        reward_first=window_mean(rewards, first=True),
        reward_last=window_mean(rewards, first=False),
        tokens_generated=generated,
        tokens_trained=trained,
        wall_s=round(time.monotonic() - state.started, 3),
        final_version=metrics[-1].version if metrics else 0,
        mode=state.config.mode,
        generated_tokens_per_s=generated / train_wall if train_wall > 0 else 0.0,
        trained_tokens_per_s=trained / train_wall if train_wall > 0 else 0.0,
        mean_step_s=sum(m.step_seconds for m in metrics) / n,
        mean_wait_s=sum(m.wait_seconds for m in metrics) / n,
        mean_publish_s=sum(m.publish_seconds for m in metrics) / n,
        weights_bytes_sent=sum(m.weights_payload_bytes for m in metrics),
        weights_bytes_full=sum(m.weights_state_bytes for m in metrics),
        checkpoint=checkpoint_of(run_dir, state.config.policies[0]),
        bubble_ratio=bubble_ratio,
        steady_generated_tokens_per_s=steady_tokens / steady_window if steady_window > 0 else 0,
        steady_seconds_per_step=steady_window / (len(metrics) - 1) if len(metrics) > 1 else 0.0,
        mode_choice=dict(state.mode_choice),
        lending_switches=scheduling.switches,
        lends=scheduling.lends,
        reclaims=scheduling.reclaims,
        requests_handed_back=scheduling.handed_back,
        lent_thread_seconds=round(sum(m.lent_thread_seconds for m in metrics), 3),
        phase_seconds=phase_seconds(run_dir / "spans.jsonl"),
        policies={policy: policy_summary(state, policy) for policy in state.config.policies},
        eval_first=eval_record(evals[0]) if evals else None,
        eval_last=eval_record(evals[-1]) if evals else None,
        restarts=dict(state.restarts),
        process_memory={label: dict(f) for label, f in sorted(state.process_memory.items())},
        config=json.loads(state.config.model_dump_json()),
        precision=state.precision.record() if state.precision else {},
        hardware=dict(state.hardware),
        data_filters=data_filter_record(state),
    )
    (run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    if any(state.metrics_by_policy.values()):
        plot_rewards(state.metrics_by_policy, run_dir / "reward_curve.png", state.run_id)
    return summary


def eval_record(evaluation: TrainEvalMetrics) -> dict[str, Any]:
    return {
        "step": evaluation.step,
        "version": evaluation.version,
        "mean_reward": evaluation.mean_reward,
        "samples": evaluation.samples,
        "task": evaluation.task,
        **({"by_task": dict(evaluation.by_task)} if evaluation.by_task else {}),
    }


def data_filter_record(state: RunState) -> dict[str, Any]:
    """``Summary.data_filters``: empty when the run recorded no data report."""
    if not state.epochs and not state.batch_reports:
        return {}
    dropped: Counter[str] = Counter()
    samples_dropped: Counter[str] = Counter()
    for report in state.batch_reports:
        dropped.update(report.groups_dropped)
        samples_dropped.update(report.samples_dropped)
    return {
        "groups_kept": sum(report.groups_kept for report in state.batch_reports),
        "groups_dropped": dict(dropped),
        "samples_dropped": dict(samples_dropped),
        "epochs": [
            {
                "stage": epoch.stage,
                "epoch": epoch.epoch,
                "prompts": epoch.prompts,
                "kept": dict(epoch.kept),
                "dropped": dict(epoch.dropped),
            }
            for epoch in sorted(state.epochs, key=lambda e: e.first_group)
        ],
    }


def checkpoint_of(run_dir: Path, policy: str) -> str | None:
    """The policy's final checkpoint, if the trainer wrote one."""
    final = checkpoints_dir(run_dir, policy) / "final"
    return str(final) if (final / "config.json").exists() else None


def policy_summary(state: RunState, policy: str) -> dict[str, Any]:
    metrics = state.metrics_by_policy[policy]
    rewards = [m.mean_reward for m in metrics]
    evals = sorted(state.evals_by_policy.get(policy, []), key=lambda e: e.step)
    return {
        "steps": len(metrics),
        "finished": policy in state.finished_by_policy,
        "reward_first": window_mean(rewards, first=True),
        "reward_last": window_mean(rewards, first=False),
        "final_version": metrics[-1].version if metrics else 0,
        "tokens_generated": sum(m.tokens_generated for m in metrics),
        "tokens_trained": sum(m.tokens_trained for m in metrics),
        "checkpoint": checkpoint_of(state.run_dir, policy),
        # each policy's own held-out evaluation (a verifier's may be another task's)
        "eval_first": eval_record(evals[0]) if evals else None,
        "eval_last": eval_record(evals[-1]) if evals else None,
    }


@dataclass
class SchedulingRecord:
    """What the tag-scheduler's spans say about lending, read in one pass."""

    lends: int = 0
    reclaims: int = 0
    handed_back: int = 0
    switches: list[dict[str, Any]] = field(default_factory=list)
    """``auto``'s changes of its measured lending choice, in the order decided."""


def read_scheduling(spans_path: Path) -> SchedulingRecord:
    """Lends, reclaims and handed-back requests (``sched.lend`` / ``sched.reclaim``),
    and the lending switches (the ``sched.decide`` spans that carry ``switch.after``)."""
    record = SchedulingRecord()
    if not spans_path.exists():
        return record
    started: list[float] = []
    with spans_path.open() as lines:
        for line in lines:
            span = json.loads(line)
            name, attributes = span["name"], span["attributes"]
            if name == "sched.lend":
                record.lends += len(attributes.get("lent", []))
            elif name == "sched.reclaim":
                record.reclaims += len(attributes.get("reclaimed", []))
                record.handed_back += int(attributes.get("handed_back", 0))
            elif name == "sched.decide" and "switch.after" in attributes:
                before = attributes.get("switch.before", -1.0)
                started.append(span.get("start", 0.0))
                record.switches.append(
                    {
                        "policy": attributes.get("policy", ""),
                        "version": attributes.get("version", 0),
                        "before": None if before < 0 else before,
                        "after": attributes["switch.after"],
                        "why": attributes.get("switch.why", ""),
                    }
                )
    order = sorted(range(len(started)), key=started.__getitem__)
    record.switches = [record.switches[i] for i in order]
    return record


def lending_switches(spans_path: Path) -> list[dict[str, Any]]:
    """The changes of ``auto``'s measured lending choice, in the order decided."""
    return read_scheduling(spans_path).switches


def phase_seconds(spans_path: Path) -> dict[str, dict[str, float]]:
    """Per resource (engine, trainer), seconds in each phase (``phase.*`` spans: idle,
    rollout, sync, train), and ``mean_sync_s``, the mean length of its ``sync``
    intervals (an engine's: loading one version; a trainer's: publishing one, with the
    evaluations that follow it)."""
    from sf_app.timeline import load_phase_spans

    if not spans_path.exists():
        return {}
    totals: dict[str, dict[str, float]] = {}
    for resource, intervals in load_phase_spans(spans_path, by_resource=True).items():
        lane = totals[resource] = {}
        for interval in intervals:
            lane[interval.phase] = lane.get(interval.phase, 0.0) + interval.end - interval.start
        syncs = [i.end - i.start for i in intervals if i.phase == "sync"]
        if syncs:
            lane["mean_sync_s"] = sum(syncs) / len(syncs)
    return {
        resource: {phase: round(seconds, 2) for phase, seconds in lane.items()}
        for resource, lane in totals.items()
    }


def struct_dict(message: TrainStepMetrics | TrainEvalMetrics) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(message)


def plot_rewards(
    metrics_by_policy: dict[str, list[TrainStepMetrics]], path: Path, title: str
) -> None:
    """One curve (per-step mean and its moving mean) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    several = len(metrics_by_policy) > 1
    for policy, metrics in metrics_by_policy.items():
        steps = [m.step for m in metrics]
        rewards = [m.mean_reward for m in metrics]
        window = max(1, len(rewards) // 10)
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1])
            / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        name = f"{policy}: " if several else ""
        ax.plot(steps, rewards, alpha=0.4, label=f"{name}mean reward per step")
        ax.plot(steps, smooth, label=f"{name}moving mean ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"reward curve: {title}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trainer_idle(metrics: list[TrainStepMetrics]) -> float:
    """The trainer's bubble, live: the share of its time over these steps spent waiting
    for a batch (``wait_seconds``) rather than training and publishing. The run's
    ``bubble_ratio`` (every resource's idle time, from the timeline) is computed at the
    end; this one is what a user watches while episodes take their time."""
    waiting = sum(m.wait_seconds for m in metrics)
    busy = sum(m.step_seconds + m.publish_seconds for m in metrics)
    return waiting / (waiting + busy) if waiting + busy > 0 else 0.0


class Progress:
    """Live terminal progress: step, mean reward, tokens/s, weight version."""

    def __init__(self, config: RunConfig, run_id: str, *, enabled: bool) -> None:
        self.config = config
        self.run_id = run_id
        self.enabled = enabled
        self._live: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render(None), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def tick(self, state: RunState) -> None:
        if self._live is not None:
            self._live.update(self._render(state))

    def update(self, state: RunState, policy: str) -> None:
        self.tick(state)
        metrics = state.metrics_by_policy[policy]
        if not self.enabled and metrics:
            m = metrics[-1]
            name = f"{policy} " if state.multi_policy else ""
            log.info("%sstep %d reward %.3f version %d trainer idle %.0f%%", name, m.step,
                     m.mean_reward, m.version, 100 * trainer_idle(metrics[-10:]))  # fmt: skip

    def _render(self, state: RunState | None) -> Any:
        from rich.table import Table

        table = Table(title=f"seamlessflow run {self.run_id}", show_header=True)
        columns = (
            "step",
            "mean reward",
            "last-10 reward",
            "gen tok/s",
            "trainer idle",
            "version",
            "elapsed",
        )
        several = len(self.config.policies) > 1
        for column in ("policy", *columns) if several else columns:
            table.add_column(column, justify="right")
        for policy in self.config.policies:
            row = self._row(state, policy)
            table.add_row(*((policy, *row) if several else row))
        if state is not None and state.status.startswith("failed"):
            table.caption = f"[bold red]{state.status}"
        return table

    def _row(self, state: RunState | None, policy: str) -> tuple[str, ...]:
        metrics = state.metrics_by_policy[policy] if state is not None else []
        if state is None or not metrics:
            waited = f"{time.monotonic() - state.started:.0f}s" if state else "0s"
            return (f"0/{self.config.steps}", "-", "-", "-", "-", "0", waited)
        m = metrics[-1]
        recent = metrics[-10:]
        elapsed = time.time() - state.started_wall
        generated = sum(x.tokens_generated for x in metrics)
        return (
            f"{m.step}/{self.config.steps}",
            f"{m.mean_reward:.3f}",
            f"{sum(x.mean_reward for x in recent) / len(recent):.3f}",
            f"{generated / elapsed:.0f}",
            f"{trainer_idle(recent):.0%}",
            str(m.version),
            f"{elapsed:.0f}s",
        )
