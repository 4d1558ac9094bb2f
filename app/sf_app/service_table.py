"""The deployable processes of a run, in one table.

``seamlessflow serve`` and ``seamlessflow config`` and the embedded run read this table;
nothing else in the application lists the services. Each process is its package's
``python -m`` entry (``sf_<name>/__main__.py``, which builds it from the environment);
``serve <name>`` runs exactly that. Services are named by import path, so the CLI
imports one only when asked to start it (``seamlessflow --help`` stays instant).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    """How the CLI, compose and the run's logs call it (``seamlessflow serve <name>``)."""
    module: str
    """The package (or module) whose ``python -m`` entry is this process."""
    settings: str
    """``module:Class`` of its own settings (``seamlessflow config`` documents them)."""
    per_policy: bool
    """One per policy of the run (multi-policy), or one for the whole run."""
    stop_stage: int
    """The embedded run stops stage 0 first, each stage draining before the next: the
    agents before the gateway, the gateway before the engines, the engines before the
    trainer and the services that feed it, the tag-scheduler last."""
    optional: bool = False
    """Started only by the runs that ask for it (the built-in environment server:
    ``--env guess_number``); it speaks HTTP to the agents, not NATS."""


SERVICE_TABLE: tuple[ServiceSpec, ...] = (
    ServiceSpec(
        "tag-scheduler",
        "sf_tag_scheduler",
        "sf_tag_scheduler.settings:TagSchedulerSettings",
        per_policy=False,
        stop_stage=4,
    ),
    ServiceSpec(
        "weight-sync",
        "sf_weight_sync",
        "sf_weight_sync.settings:WeightSyncSettings",
        per_policy=True,
        stop_stage=3,
    ),
    ServiceSpec(
        "trajectory",
        "sf_trajectory",
        "sf_trajectory.settings:TrajectorySettings",
        per_policy=False,
        stop_stage=3,
    ),
    ServiceSpec(
        "trainer",
        "sf_trainer",
        "sf_trainer.settings:TrainerSettings",
        per_policy=True,
        stop_stage=3,
    ),
    ServiceSpec(
        "gateway",
        "sf_gateway",
        "sf_gateway.settings:GatewaySettings",
        per_policy=False,
        stop_stage=1,
    ),
    ServiceSpec(
        "engine",
        "sf_engine",
        "sf_engine.settings:EngineSettings",
        per_policy=True,
        stop_stage=2,
    ),
    ServiceSpec(
        "env",
        "sf_envs",
        "sf_envs.settings:EnvServerSettings",
        per_policy=False,
        stop_stage=1,
        optional=True,
    ),
    ServiceSpec(
        "agents",
        "sf_agents",
        "sf_agents.settings:AgentRunnerSettings",
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


def serve(name: str) -> None:
    """Run this process as service ``name``: its ``python -m`` entry, as it is."""
    import runpy
    import sys

    # settings come from the environment only: the entry sees no arguments (not ours:
    # "serve <name>" is no option of the built-in environment server's command line)
    sys.argv = [sys.argv[0]]
    runpy.run_module(spec_of(name).module, run_name="__main__", alter_sys=True)


SHARED_SETTINGS: dict[str, str] = {
    "every service": "seamlessflow.settings:MeshSettings",
    "stream retention": "seamlessflow.settings:RetentionSettings",
    "weight transfer": "seamlessflow.weights.settings:WeightTransferSettings",
    "hf engine backend": "sf_engine.settings:HfSettings",
    "vllm engine backend": "sf_engine.settings:VllmSettings",
    "scripted engine (load tests)": "sf_engine.backends.scripted_engine:ScriptedSettings",
    "code sandbox (reward code_tests)": "seamlessflow.rewards.sandbox:SandboxSettings",
}
"""Settings read by more than one service, or by a plug-in; each service's own come
from the service table."""
SETTINGS: dict[str, str] = {
    **SHARED_SETTINGS,
    **{spec.name: spec.settings for spec in SERVICE_TABLE},
}


def settings_classes() -> list[Any]:
    """Every settings class of the mesh (what a run file's sections may name)."""
    return [load(path) for path in dict.fromkeys(SETTINGS.values())]
