from pydantic_settings import BaseSettings, SettingsConfigDict


class TrajectorySettings(BaseSettings):
    """trajectory settings (env prefix ``SF_TRAJECTORY_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TRAJECTORY_", extra="ignore", use_attribute_docstrings=True
    )

    task: str = "arithmetic"
    """Name of the task source (``seamlessflow.tasks``) the agents roll out."""

    seed: int = 0
    """Seed for the task order (each epoch is a fresh permutation)."""

    group_size: int = 8
    """Samples per task: one GRPO group."""

    groups_per_batch: int = 8
    """Groups in one trainer batch (one optimizer step)."""

    total_batches: int = 0
    """Stop dispatching after this many batches' worth of groups (0 = never stop)."""

    max_staleness: int = 4
    """Staleness bound: a sample with a token generated more than this many versions
    before the version that will train it is dropped (reason ``stale``)."""

    max_batches_ahead: int = 1
    """Rollout rhythm: how many batches may be dispatched beyond what the trainer has
    consumed. 0 = synchronous (on-policy); larger values overlap rollout and training
    at the cost of staleness (a sample is at most ``max_batches_ahead + 1`` versions old)."""
