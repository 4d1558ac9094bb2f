"""``seamlessflow compare RUN_DIR...``: several runs side by side.

Reads what every run writes (``summary.json``, ``metrics.jsonl``): a table of the
figures people compare runs by, and one figure with three panels overlaid per run:
mean reward by optimizer step, mean reward by time since the run's first step (the
same reward reached sooner is the point of a faster deployment), and generated tokens
per second by step. Typical use: the three deployment modes of one task, or one
change against its baseline.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COLUMNS: tuple[tuple[str, str], ...] = (
    ("run", "run_id"),
    ("mode", "mode"),
    ("status", "status"),
    ("steps", "steps"),
    ("reward first", "reward_first"),
    ("reward last", "reward_last"),
    ("s/step", "steady_seconds_per_step"),
    ("gen tok/s", "steady_generated_tokens_per_s"),
    ("bubble", "bubble_ratio"),
    ("wall s", "wall_s"),
)
"""Table header -> ``summary.json`` field."""


class NotARun(ValueError):
    """A directory without the files a run writes."""


@dataclass
class RunRecord:
    run_dir: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    """The first policy's ``train.metrics`` lines, in order."""

    @property
    def name(self) -> str:
        return str(self.summary.get("run_id") or self.run_dir.name)


def load_run(run_dir: Path) -> RunRecord:
    summary_path, metrics_path = run_dir / "summary.json", run_dir / "metrics.jsonl"
    if not summary_path.exists():
        raise NotARun(f"{run_dir} is not a run directory (no summary.json)")
    summary = json.loads(summary_path.read_text())
    policies = summary.get("config", {}).get("policies") or []
    first = policies[0] if policies else None
    steps = []
    if metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            row = json.loads(line)
            if row.get("type") == "train.metrics" and (first is None or row["policy"] == first):
                steps.append(row)
    return RunRecord(run_dir, summary, steps)


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def table(records: list[RunRecord]) -> str:
    """A fixed-width text table, one row per run."""
    rows = [[header for header, _ in COLUMNS]]
    for record in records:
        rows.append([cell(record.summary.get(key)) for _, key in COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(value.rjust(width) for value, width in zip(row, widths, strict=True))
        for row in rows
    )


def moving_mean(values: list[float]) -> list[float]:
    """Trailing mean over a tenth of the run (at least one value)."""
    window = max(1, len(values) // 10)
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def generated_tokens_per_s(steps: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, tokens generated since the previous step / the time between them)."""
    rates = []
    for previous, current in itertools.pairwise(steps):
        interval = current["timestamp"] - previous["timestamp"]
        if interval > 0:
            rates.append((current["step"], current["tokens_generated"] / interval))
    return rates


def plot(records: list[RunRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time, speed) = plt.subplots(1, 3, figsize=(15, 4))
    for record in records:
        if not record.steps:
            continue
        steps = [row["step"] for row in record.steps]
        rewards = moving_mean([row["mean_reward"] for row in record.steps])
        start = record.steps[0]["timestamp"]
        seconds = [row["timestamp"] - start for row in record.steps]
        by_step.plot(steps, rewards, label=record.name)
        by_time.plot(seconds, rewards, label=record.name)
        rates = generated_tokens_per_s(record.steps)
        if rates:
            speed.plot([s for s, _ in rates], moving_mean([r for _, r in rates]), label=record.name)
    by_step.set(xlabel="optimizer step", ylabel="mean reward (moving mean)")
    by_time.set(xlabel="seconds since the first step", ylabel="mean reward (moving mean)")
    speed.set(xlabel="optimizer step", ylabel="generated tokens/s (moving mean)")
    for axes in (by_step, by_time, speed):
        axes.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
