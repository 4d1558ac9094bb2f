from pydantic_settings import BaseSettings, SettingsConfigDict

from sf_tag_scheduler.policy import Mode


class TagSchedulerSettings(BaseSettings):
    """tag-scheduler settings (env prefix ``SF_TAG_SCHEDULER_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TAG_SCHEDULER_", extra="ignore", use_attribute_docstrings=True
    )

    mode: Mode = "disaggregated"
    """Deployment mode: colocated | disaggregated | multiplexed (a policy configuration)."""

    dead_after_s: float = 5.0
    """A resource whose last heartbeat is older than this is declared dead."""

    check_interval_s: float = 0.5
    """How often liveness is checked."""
