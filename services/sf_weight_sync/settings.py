from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings


class WeightSyncSettings(RunFileSettings):
    """weight-sync settings (env prefix ``SF_WEIGHT_SYNC_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_WEIGHT_SYNC_", extra="ignore", use_attribute_docstrings=True
    )

    sync_timeout_s: float = 60.0
    """How long a sync span waits for every known engine to report the new version."""

    engine_expiry_s: float = 60.0
    """An engine not heard from for this long (engines ask for the current version every
    ``SF_ENGINE_VERSION_POLL_S`` and report each version they load) is forgotten: sync
    spans stop waiting for it. One the tag-scheduler declares dead is forgotten at once.
    Keeps the set of known engines to the live ones, whoever sends a query."""
