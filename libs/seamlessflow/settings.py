"""Settings shared by every service (env prefix ``SF_``).

Each service adds its own settings class with its own prefix (``SF_TRAINER_`` ...);
see the service's ``config.py``. Every field has a docstring: they are the
configuration reference (``seamlessflow config`` prints them).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from seamlessflow.protocol import check_run_id


class MeshSettings(BaseSettings):
    """Where the mesh is and which run this process belongs to."""

    model_config = SettingsConfigDict(
        env_prefix="SF_", extra="ignore", use_attribute_docstrings=True
    )

    nats_url: str = "nats://127.0.0.1:4222"
    """NATS server URL (JetStream enabled)."""

    run_id: str = "default"
    """Run identifier; namespaces every subject, stream and bucket (``[a-z0-9-]``)."""

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

    def tags(self, default: list[str]) -> list[str]:
        return _split(self.resource_tags) or default

    def slots(self) -> list[str]:
        return _split(self.resource_slots)


def _split(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
