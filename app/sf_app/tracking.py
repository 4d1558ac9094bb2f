"""Experiment tracking: a run's metrics into TensorBoard and Weights & Biases.

``--report-to`` takes the names TRL uses: ``none``, ``tensorboard``, ``wandb``, several
at once (``tensorboard,wandb``) or ``all`` (every one whose library is installed). The
libraries are extras (``pip install 'seamlessflow[tensorboard,wandb]'``): neither is
imported unless chosen.

Fed by the trainers' metrics stream, in the one process that follows it (the embedded
run's runner, or ``seamlessflow track`` beside a deployed mesh): the trainer never
waits for a tracker. What is logged:

- at start: the run's configuration (and its run file, when it has one);
- per optimizer step: every numeric field of ``TrainStepMetrics`` under
  ``<section>/<field>`` and these derived figures: ``generated_tokens_per_s`` (tokens
  generated since the previous step / the time between the two steps),
  ``trained_tokens_per_s`` (tokens trained / the step's compute time),
  ``trainer_idle_fraction`` (the trainer slot's bubble in that step: wait / (wait +
  compute + publish)); ``<section>`` is ``train`` in a single-policy run and the
  policy's name in a multi-policy one (one series per policy);
- per evaluation: ``eval/<field>`` (``<policy>/eval/<field>`` with several policies);
- at the end: the summary's figures (bubble ratio over every slot, weight-sync bytes,
  steady throughput, lends and reclaims) and the reward curve and timeline figures.

Each backend's x axis is the policy's optimizer step (W&B: one step metric per section,
so that policies interleaving their steps do not drop each other's points).
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import msgspec

from seamlessflow.bus import Bus, next_message
from seamlessflow.protocol import (
    TrainEvalMetrics,
    TrainingFinished,
    TrainProgress,
    TrainStepMetrics,
    decode,
)

log = logging.getLogger(__name__)

BACKENDS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Backend name -> the module that must be importable (its extra)."""

NOT_PLOTTED = frozenset({"step", "policy", "timestamp"})
"""Fields of the metrics messages that are the axis or the series, not values."""

SUMMARY_FIGURES = (
    "bubble_ratio",
    "steady_generated_tokens_per_s",
    "steady_seconds_per_step",
    "generated_tokens_per_s",
    "trained_tokens_per_s",
    "mean_step_s",
    "mean_wait_s",
    "mean_publish_s",
    "weights_bytes_sent",
    "weights_bytes_full",
    "lends",
    "reclaims",
    "requests_handed_back",
    "reward_first",
    "reward_last",
    "wall_s",
)
"""``summary.json`` figures logged once at the end (``sf_app.run.report.Summary``)."""

FIGURES = ("reward_curve.png", "timeline.png")
"""Images of the run directory logged at the end, when they were drawn."""


class ReportToError(ValueError):
    """``--report-to`` names an unknown backend or one whose library is missing."""


def parse_report_to(value: str | Iterable[str]) -> tuple[str, ...]:
    """The backends ``value`` chooses, in order, each once. ``none`` (or nothing) is
    none; ``all`` is every backend whose library is installed."""
    items = value.split(",") if isinstance(value, str) else list(value)
    names = [item.strip().lower() for item in items if item.strip()]
    chosen: list[str] = []
    for name in names:
        if name == "none":
            continue
        if name == "all":
            chosen += [b for b, module in BACKENDS.items() if _installed(module)]
            continue
        if name not in BACKENDS:
            known = ", ".join(["none", "all", *BACKENDS])
            raise ReportToError(f"unknown --report-to {name!r}; known: {known}")
        if not _installed(BACKENDS[name]):
            raise ReportToError(
                f"--report-to {name} needs the {name} library: pip install 'seamlessflow[{name}]'"
            )
        chosen.append(name)
    return tuple(dict.fromkeys(chosen))


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


class Backend(Protocol):
    """One tracking backend: scalars by key on a step axis, a run summary, images."""

    def log(self, section: str, values: dict[str, float], step: int) -> None: ...

    def summary(self, values: dict[str, float]) -> None: ...

    def image(self, tag: str, path: Path) -> None: ...

    def close(self) -> None: ...


class TensorBoardBackend:
    """Event files under ``<run_dir>/tensorboard`` (``tensorboard --logdir`` them)."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.logdir), flush_secs=10)
        self.writer.add_text("config", _markdown_table(config), 0)
        self.last_step = 0

    def log(self, section: str, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"{section}/{key}", value, step)
        self.last_step = max(self.last_step, step)

    def summary(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(f"summary/{key}", value, self.last_step)

    def image(self, tag: str, path: Path) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(str(path))  # float RGB(A) in [0, 1]
        self.writer.add_image(tag, pixels[..., :3], self.last_step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """A W&B run named after the run id, in ``<run_dir>/wandb``. Offline (no network)
    with ``WANDB_MODE=offline``: ``wandb sync`` uploads it later. The project is
    ``WANDB_PROJECT`` (default ``seamlessflow``)."""

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "seamlessflow"),
            name=run_id,
            dir=str(run_dir),
            config=config,
            reinit="create_new",
        )
        self._sections: set[str] = set()

    def log(self, section: str, values: dict[str, float], step: int) -> None:
        if section not in self._sections:
            # each section's own x axis: policies' steps interleave, and W&B drops a
            # point whose global step is below the last one logged
            self.run.define_metric(f"{section}/step", hidden=True)
            self.run.define_metric(f"{section}/*", step_metric=f"{section}/step")
            self._sections.add(section)
        self.run.log({f"{section}/step": step, **{f"{section}/{k}": v for k, v in values.items()}})

    def summary(self, values: dict[str, float]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in values.items()})

    def image(self, tag: str, path: Path) -> None:
        import wandb

        self.run.log({tag: wandb.Image(str(path))})

    def close(self) -> None:
        """Finish the run; on return its files under ``<run_dir>/wandb`` are complete.

        ``finish`` returns once the W&B service has taken the run's last record, not
        once it has written it: the service closes the run's transaction log only later,
        on its own (an offline run read back right after ``finish`` may hold no rows
        yet). Tearing the service down waits for it to close every file and exit; the
        next run starts a new one."""
        import wandb

        self.run.finish()
        wandb.teardown()


BACKEND_CLASSES: dict[str, type[TensorBoardBackend] | type[WandbBackend]] = {
    "tensorboard": TensorBoardBackend,
    "wandb": WandbBackend,
}


class Tracker:
    """The run's metrics, named and derived once, fanned out to the chosen backends.

    A backend that fails while logging is closed and dropped with a warning: tracking
    never stops a run."""

    def __init__(
        self,
        backends: Iterable[str],
        *,
        run_dir: Path,
        run_id: str,
        policies: list[str],
        config: dict[str, Any],
    ) -> None:
        self.policies = policies
        self.backends: dict[str, Backend] = {}
        try:
            for name in backends:
                self.backends[name] = BACKEND_CLASSES[name](run_dir, run_id, config)
        except Exception:
            self.close()  # the ones already started (a W&B run would stay open)
            raise
        self._previous_timestamp: dict[str, float] = {}

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def section(self, policy: str) -> str:
        return policy if len(self.policies) > 1 else "train"

    def step(self, metrics: TrainStepMetrics) -> None:
        values = step_values(metrics, self._previous_timestamp.get(metrics.policy))
        self._previous_timestamp[metrics.policy] = metrics.timestamp
        self._each("log", self.section(metrics.policy), values, metrics.step)

    def evaluation(self, metrics: TrainEvalMetrics) -> None:
        section = "eval" if len(self.policies) == 1 else f"{metrics.policy}/eval"
        values = numeric_fields(metrics)
        # several tasks evaluated: each one's score is a curve of its own
        values.update({f"mean_reward/{task}": score for task, score in metrics.by_task.items()})
        self._each("log", section, values, metrics.step)

    def finish(self, summary: dict[str, Any], run_dir: Path) -> None:
        """The summary's figures and the run's figures, once, at the end."""
        figures = {
            key: float(summary[key])
            for key in SUMMARY_FIGURES
            if isinstance(summary.get(key), int | float) and not isinstance(summary[key], bool)
        }
        self._each("summary", figures)
        for name in FIGURES:
            path = run_dir / name
            if path.exists():
                self._each("image", f"figures/{path.stem}", path)

    def close(self) -> None:
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception:  # a tracker never fails the run
                log.warning("closing the %s tracker failed", name, exc_info=True)
        self.backends.clear()

    def _each(self, method: str, *args: Any) -> None:
        for name, backend in list(self.backends.items()):
            try:
                getattr(backend, method)(*args)
            except Exception:  # a tracker never fails the run
                log.warning("the %s tracker failed; dropped for this run", name, exc_info=True)
                self.backends.pop(name)
                try:
                    backend.close()
                except Exception:  # closing what just failed is best-effort
                    log.debug("closing the failed %s tracker failed too", name, exc_info=True)


def numeric_fields(message: msgspec.Struct) -> dict[str, float]:
    """Every int or float field of a metrics message (not the axis or the series)."""
    values: dict[str, float] = {}
    for name, value in msgspec.structs.asdict(message).items():
        if name in NOT_PLOTTED or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            values[name] = float(value)
    return values


def step_values(metrics: TrainStepMetrics, previous_timestamp: float | None) -> dict[str, float]:
    """A step's values: its numeric fields and the figures derived from them."""
    values = numeric_fields(metrics)
    if previous_timestamp is not None and metrics.timestamp > previous_timestamp:
        values["generated_tokens_per_s"] = metrics.tokens_generated / (
            metrics.timestamp - previous_timestamp
        )
    if metrics.step_seconds > 0:
        values["trained_tokens_per_s"] = metrics.tokens_trained / metrics.step_seconds
    busy_and_idle = metrics.wait_seconds + metrics.step_seconds + metrics.publish_seconds
    if busy_and_idle > 0:
        values["trainer_idle_fraction"] = metrics.wait_seconds / busy_and_idle
    return values


def _markdown_table(config: dict[str, Any]) -> str:
    rows = "\n".join(f"| {key} | {value} |" for key, value in sorted(config.items()))
    return "| setting | value |\n|---|---|\n" + rows


STREAM_WAIT_LOG_S = 30.0
"""``seamlessflow track`` says it is still waiting for the run this often."""


async def track_run(bus: Bus, tracker: Tracker, policies: list[str], stop: asyncio.Event) -> int:
    """Follow a run's metrics stream from its start into ``tracker`` until every policy
    announced its finish (or ``stop``): ``seamlessflow track`` beside a deployed mesh.
    Steps of other policies are skipped. Returns the steps tracked."""
    stream = bus.subjects.stream_metrics()
    waited = 0.0
    while not await bus.stream_exists(stream):
        if stop.is_set():
            return 0
        if waited % STREAM_WAIT_LOG_S == 0:
            log.info("waiting for run %s to start (no %s yet)", bus.subjects.run_id, stream)
        await asyncio.sleep(1.0)
        waited += 1.0
    sub, _ = await bus.follow(stream, bus.subjects.train_all())
    finished: set[str] = set()
    steps = 0
    while not stop.is_set() and not finished >= set(policies):
        msg = await next_message(sub, timeout=1.0)
        if msg is None:
            continue
        try:
            message = decode(msg.data, TrainProgress)
        except ValueError as exc:  # a producer of another version: skip, say so
            log.warning("skipped a metrics message: %s", exc)
            continue
        if message.policy not in policies:
            continue
        if isinstance(message, TrainStepMetrics):
            tracker.step(message)
            steps += 1
        elif isinstance(message, TrainEvalMetrics):
            tracker.evaluation(message)
        elif isinstance(message, TrainingFinished):
            finished.add(message.policy)
    return steps
