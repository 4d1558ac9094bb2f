"""Settings shared by every service (env prefix ``SF_``).

Each service adds its own settings class with its own prefix (``SF_TRAINER_`` ...);
see the service's ``settings.py``. Every field has a docstring: they are the
configuration reference (``seamlessflow config`` prints them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.protocol import DEFAULT_POLICY, check_policy, check_run_id
from seamlessflow.runfile import RunFileSettings, shared

REPLACED_VARIABLES = {
    "SF_TRAINER_SEED": "the run's seed is SF_SEED, one for every service",
    "SF_TRAJECTORY_SEED": "the run's seed is SF_SEED, one for every service",
    "SF_TRAINER_EVAL_TASK_SEED": "the evaluation split uses the run's seed, SF_SEED",
    "SF_TRAJECTORY_TOTAL_BATCHES": (
        "the trajectory service dispatches for the step budget each trainer announces (SF_STEPS)"
    ),
}
"""Variables earlier versions read, and what replaced each: set, they stop a process
with that line instead of being ignored."""


class MeshSettings(RunFileSettings):
    """Where the mesh is and which run this process belongs to."""

    model_config = SettingsConfigDict(
        env_prefix="SF_", extra="ignore", use_attribute_docstrings=True
    )

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL (JetStream enabled), or several servers of one cluster separated
    by commas (any of them takes the connection; another one when it goes away). No
    credentials in it: URLs get logged."""

    nats_replicas: int = Field(default=1, ge=1, le=5)
    """Replicas of every stream, KV and object bucket the run creates (a cluster of at
    least this many JetStream servers). An existing stream with another count stops the
    service with one line."""

    nats_token: SecretStr = SecretStr("")
    """Token the NATS server requires (``nats-server --auth``, or the token the embedded
    run makes for its own server); empty = none."""

    nats_connect_wait_s: float = 15.0
    """How long a process retries its first connection to a NATS server it cannot reach;
    then it exits with one line saying so. Refused credentials fail at once. Once
    connected, a server that goes away is waited for without limit."""

    run_id: str = "default"
    """Run identifier; namespaces every subject, stream and bucket (``[a-z0-9-]``)."""

    policy: str = DEFAULT_POLICY
    """The policy this process serves or trains (engine workers, trainer, weight-sync):
    its engine, weight, batch and trainer subjects, streams and object store are its
    own, and its resources register with the tag ``policy:<name>``. Agents reach it by
    asking for the model of that name."""

    policies: str = shared("policies")
    """Every policy of the run, comma-separated (multi-policy: ``solver,verifier``); the
    gateway serves each as a model and the trajectory service batches for each. The
    first is the tasks' policy: a task's reward function scores its answers, and SRPO's
    history resampling follows its groups. Empty = ``policy`` alone."""

    seed: int = shared("seed")
    """The run's seed, one for every service: the task order (the trajectory service's
    split and epochs), torch in the trainer, and the trainer's evaluation split (which is
    held out of the rolled-out one only when both use the same seed). A trainer
    announces its seed (``TrainingPlanned``); a trajectory service with another exits
    naming both."""

    run_dir: Path | None = None
    """Directory for this process's spans (``spans/<service>-<host>-<pid>.jsonl``) and artefacts."""

    model_dir: Path | None = None
    """The base model directory (HF layout: config, safetensors, tokenizer)."""

    resource_tags: str = ""
    """Comma-separated capability tags this process registers with (``train,rollout``).
    An engine tagged both ``train`` and ``rollout`` sits on a training slot and is lent
    to rollout only while the trainer waits (see ``sf_tag_scheduler.policy``)."""

    resource_slots: str = ""
    """Comma-separated physical slots (cores, GPUs) this process computes on, e.g.
    ``node1-gpu0``; empty = its own resource id. Processes naming the same slot share it
    in time: the timeline draws one lane per slot."""

    drain_timeout_s: float = 15.0
    """On SIGTERM, how long the service may take to finish in-flight work before cancel."""

    log_level: str = "INFO"
    """Python log level."""

    otlp_endpoint: str = Field(
        default="",
        validation_alias=AliasChoices("SF_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    """OTLP/HTTP endpoint for spans, a base URL (e.g. http://jaeger:4318; ``/v1/traces``
    is appended). ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (a full URL) wins over it; the
    other ``OTEL_*`` variables apply as the OpenTelemetry SDK defines them
    (docs/observability.md). Empty = JSONL only."""

    @field_validator("run_id")
    @classmethod
    def _valid_run_id(cls, value: str) -> str:
        return check_run_id(value)

    @model_validator(mode="after")
    def _no_replaced_variables(self) -> MeshSettings:
        # a variable that is no longer read would be ignored without a word
        for name, instead in REPLACED_VARIABLES.items():
            if name in os.environ:
                raise ValueError(f"{name} is no longer read: {instead}")
        return self

    @field_validator("policy")
    @classmethod
    def _valid_policy(cls, value: str) -> str:
        return check_policy(value)

    @field_validator("policies")
    @classmethod
    def _valid_policies(cls, value: str) -> str:
        names = [check_policy(name) for name in _split(value)]
        if len(set(names)) != len(names):
            raise ValueError(f"a policy is listed twice: {value!r}")
        return value

    def policy_names(self) -> list[str]:
        """The run's policies, the tasks' policy first."""
        return _split(self.policies) or [self.policy]

    def tags(self, default: list[str]) -> list[str]:
        return _split(self.resource_tags) or default

    def slots(self) -> list[str]:
        return _split(self.resource_slots)


HOUR_S = 3600.0
GB = 1024**3


@dataclass(frozen=True)
class StreamLimits:
    """What one durable stream keeps: messages younger than ``max_age_s``, within
    ``max_bytes`` (0 = no limit); past either, the oldest messages are dropped."""

    max_age_s: float
    max_bytes: int


class RetentionSettings(RunFileSettings):
    """How long the run's durable streams keep their messages, and how many bytes.

    A restart rebuilds each service's state from these streams, so a limit decides what
    a restart still knows; the defaults keep everything a restart needs, and a run of
    any length keeps running. Byte limits are off by default: the NATS server reserves
    a stream's byte limit when it creates the stream and refuses streams whose limits
    together exceed its storage. See docs/design.md, "What is kept and for how long".
    The weights object store is not limited here: it holds only the payload chains the
    trainer keeps (``SF_WEIGHTS_KEEP_CHAINS``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_RETENTION_", extra="ignore", use_attribute_docstrings=True
    )

    trajectory_max_age_h: float = 48.0
    """Trajectory events (the record of every session) older than this are dropped
    (0 = never). A restart rebuilds the open sessions and groups from them (a group is
    open for at most ``SF_GROUP_TIMEOUT_S`` without progress), and
    ``export`` reads a session from them: an older session can no longer be exported."""

    trajectory_max_gb: float = 0.0
    """Byte limit of the trajectory stream; past it the oldest events are dropped (0 = no
    limit). Keep it far above what is written within the group time-out."""

    batches_max_age_h: float = 72.0
    """Training batches (and their payloads) older than this are dropped, trained or not
    (0 = never). At least ``trajectory_max_age_h``: a restarted trajectory service
    learns from the batches which sessions were batched already, for as long as their
    events exist."""

    batches_max_gb: float = 0.0
    """Byte limit of each policy's batch stream and of its batch payload stream (the
    server reserves it for each); past it the oldest batches (trained first: the
    trainer's backlog is ``SF_MAX_BATCHES_AHEAD``) are dropped (0 = no
    limit). Keep it no lower than ``trajectory_max_gb``, for the same reason."""

    metrics_max_age_h: float = 720.0
    """Trainer metrics, batch and epoch reports older than this are dropped (0 = never).
    A restart reads its step and version from the latest metrics and the data filters'
    history from the reports: an epoch longer than this is forgotten by a restart."""

    metrics_max_gb: float = 0.0
    """Byte limit of the metrics stream; past it the oldest reports are dropped (0 = no
    limit)."""

    @field_validator("*")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("a retention limit is 0 (none) or positive")
        return value

    @model_validator(mode="after")
    def _batches_outlast_the_trajectory(self) -> RetentionSettings:
        trajectory, batches = self.trajectory_max_age_h, self.batches_max_age_h
        if batches and (not trajectory or batches < trajectory):
            raise ValueError(
                "SF_RETENTION_BATCHES_MAX_AGE_H must be 0 or at least "
                "SF_RETENTION_TRAJECTORY_MAX_AGE_H (a restart would batch again the "
                "sessions of dropped batches whose events are still stored)"
            )
        return self

    def trajectory(self) -> StreamLimits:
        return StreamLimits(self.trajectory_max_age_h * HOUR_S, _bytes(self.trajectory_max_gb))

    def batches(self) -> StreamLimits:
        return StreamLimits(self.batches_max_age_h * HOUR_S, _bytes(self.batches_max_gb))

    def metrics(self) -> StreamLimits:
        return StreamLimits(self.metrics_max_age_h * HOUR_S, _bytes(self.metrics_max_gb))


def _bytes(gb: float) -> int:
    return int(gb * GB)


def checkpoints_dir(run_dir: Path, policy: str = DEFAULT_POLICY) -> Path:
    """Where a policy's trainer writes its checkpoints: ``<run_dir>/checkpoints`` for the
    default policy (every single-policy run), ``<run_dir>/checkpoints/<policy>`` else."""
    root = run_dir / "checkpoints"
    return root if policy == DEFAULT_POLICY else root / check_policy(policy)


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
