"""Settings shared by every service (env prefix ``SF_``).

Each service adds its own settings class with its own prefix (``SF_TRAINER_`` ...);
see the service's ``config.py``. Every field has a docstring: they are the
configuration reference (``seamlessflow config`` prints them).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from seamlessflow.protocol import DEFAULT_POLICY, check_policy, check_run_id


class MeshSettings(BaseSettings):
    """Where the mesh is and which run this process belongs to."""

    model_config = SettingsConfigDict(
        env_prefix="SF_", extra="ignore", use_attribute_docstrings=True
    )

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL (JetStream enabled). No credentials in it: URLs get logged."""

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

    policies: str = ""
    """Every policy of the run, comma-separated (multi-policy: ``solver,verifier``); the
    gateway serves each as a model and the trajectory service batches for each. The
    first is the tasks' policy: a task's reward function scores its answers, and SRPO's
    history resampling follows its groups. Empty = ``policy`` alone."""

    run_dir: Path | None = None
    """Directory for this process's spans (``spans/<service>.jsonl``) and artefacts."""

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
    """OTLP/HTTP endpoint for spans (e.g. http://jaeger:4318); empty = JSONL only."""

    @field_validator("run_id")
    @classmethod
    def _valid_run_id(cls, value: str) -> str:
        return check_run_id(value)

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


def checkpoints_dir(run_dir: Path, policy: str = DEFAULT_POLICY) -> Path:
    """Where a policy's trainer writes its checkpoints: ``<run_dir>/checkpoints`` for the
    default policy (every single-policy run), ``<run_dir>/checkpoints/<policy>`` else."""
    root = run_dir / "checkpoints"
    return root if policy == DEFAULT_POLICY else root / check_policy(policy)


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
