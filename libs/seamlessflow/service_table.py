"""The deployable processes of a run, in one table.

``seamlessflow serve`` and ``seamlessflow config``, the embedded run and every service's
``__main__`` read this table; nothing else lists the services. A service is named by its
import path, so the library imports a service only when asked to start it (and never
at import time).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    """How the CLI, compose and the run's logs call it (``seamlessflow serve <name>``)."""
    service: str
    """``module:Class`` of the service object, built with no arguments (its settings come
    from the environment)."""
    settings: str
    """``module:Class`` of its own settings (``seamlessflow config`` documents them)."""
    per_policy: bool
    """One per policy of the run (multi-policy), or one for the whole run."""
    stop_stage: int
    """The embedded run stops stage 0 first, each stage draining before the next: the
    agents before the gateway, the gateway before the engines, the engines before the
    trainer and the services that feed it, the tag-scheduler last."""
    entry: str = ""
    """``module:function`` that runs the process instead, when it does not start as one
    service (the trainer: one process per torch.distributed rank, rank 0 joins the mesh)."""


SERVICE_TABLE: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "tag-scheduler",
        "sf_tag_scheduler.service:TagScheduler",
        "sf_tag_scheduler.config:TagSchedulerSettings",
        per_policy=False,
        stop_stage=4,
    ),
    ServiceSpec(
        "weight-sync",
        "sf_weight_sync.service:WeightSync",
        "sf_weight_sync.config:WeightSyncSettings",
        per_policy=True,
        stop_stage=3,
    ),
    ServiceSpec(
        "trajectory",
        "sf_trajectory.service:TrajectoryService",
        "sf_trajectory.config:TrajectorySettings",
        per_policy=False,
        stop_stage=3,
    ),
    ServiceSpec(
        "trainer",
        "sf_trainer.service:Trainer",
        "sf_trainer.config:TrainerSettings",
        per_policy=True,
        stop_stage=3,
        entry="sf_trainer.launch:main",
    ),
    ServiceSpec(
        "gateway",
        "sf_gateway.gateway:GatewayService",
        "sf_gateway.config:GatewaySettings",
        per_policy=False,
        stop_stage=1,
    ),
    ServiceSpec(
        "engine",
        "sf_engine.worker:EngineWorker",
        "sf_engine.config:EngineSettings",
        per_policy=True,
        stop_stage=2,
    ),
    ServiceSpec(
        "agents",
        "seamlessflow.agents.runner:AgentRunner",
        "seamlessflow.agents.runner:AgentRunnerSettings",
        per_policy=False,
        stop_stage=0,
    ),
)
"""Every service, in the order the embedded run starts them: infrastructure first, so
that resources find the scheduler and weight-sync."""

SERVICE_NAMES: tuple[str, ...] = tuple(spec.name for spec in SERVICE_TABLE)


def spec_of(name: str) -> ServiceSpec:
    for spec in SERVICE_TABLE:
        if spec.name == name:
            return spec
    raise ValueError(f"unknown service {name!r}; known: {', '.join(SERVICE_NAMES)}")


def load(path: str) -> Any:
    """The object a ``module:attribute`` path names (imports the module)."""
    module_name, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def run_process(name: str) -> None:
    """This process is service ``name``: its entry, or the service skeleton around it.
    Settings are read from the environment; invalid ones end the process with one line
    naming each problem (exit code ``EXIT_UNRECOVERABLE``: a supervisor that restarts
    it would only meet the same error)."""
    from pydantic import ValidationError

    from seamlessflow.bus import EXIT_UNRECOVERABLE

    spec = spec_of(name)
    try:
        if spec.entry:
            load(spec.entry)()
            return
        from seamlessflow.service import main

        main(load(spec.service)())
    except ValidationError as exc:
        problems = "; ".join(
            ".".join(map(str, error["loc"])) + ": " + error["msg"] if error["loc"] else error["msg"]
            for error in exc.errors()
        )
        print(f"{name}: invalid settings ({exc.title}): {problems}", file=sys.stderr)
        raise SystemExit(EXIT_UNRECOVERABLE) from None
