from pydantic_settings import BaseSettings, SettingsConfigDict


class WeightSyncSettings(BaseSettings):
    """weight-sync settings (env prefix ``SF_WEIGHT_SYNC_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_WEIGHT_SYNC_", extra="ignore", use_attribute_docstrings=True
    )

    sync_timeout_s: float = 60.0
    """How long a sync span waits for every known engine to report the new version."""
