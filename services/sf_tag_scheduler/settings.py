"""The tag-scheduler's settings (``SF_TAG_SCHEDULER_*``), and the policy configuration they make."""

from typing import Self

from pydantic import model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings, shared
from sf_tag_scheduler.policy import Mode, PolicyConfig


class TagSchedulerSettings(RunFileSettings):
    """tag-scheduler settings (env prefix ``SF_TAG_SCHEDULER_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TAG_SCHEDULER_", extra="ignore", use_attribute_docstrings=True
    )

    mode: Mode = shared("mode")
    """How engines on training slots (tagged ``train`` and ``rollout``) are lent while
    the trainer waits: ``colocated`` and ``multiplexed`` always, ``disaggregated``
    never, ``auto`` (the default) while steps/s measured with lending beat steps/s
    without (``when_pays``), switching when the measurements change. The tags make the
    deployment: with no lendable engine, every mode keeps the slots."""

    lend_margin: float = 0.0
    """``auto``: lend when steps/s with lending exceed steps/s without by more
    than this fraction (both measured on the run over blocks of steps)."""

    lend_block_steps: int = 3
    """``auto``: consecutive trainer waits that take one lending choice; their
    step periods (the first left out: it carries over the previous choice) measure it."""

    lend_shares: tuple[float, ...] = (1.0,)
    """``auto``: the shares of the lendable engines a block of waits may lend
    besides none, each measured like "lend all" (JSON, e.g. ``[0.5, 1.0]``: half or all;
    must include 1.0). The default is all or nothing."""

    reclaim_early_at: float = 1.0
    """Take lent engines back while the trainer still waits, once this share of the
    next batch's groups is ready (the trajectory service's BatchProgress), so that the
    reclaim overlaps the end of rollout; 1.0: at the trainer's claim."""

    rebalance_on_lend: bool = True
    """Once lent engines serve, move in-flight requests onto them from the busiest
    engines (partial rollout); without it a lent engine gets only new requests."""

    lend_cores_to_training: bool = True
    """Lending in the other direction: while the trainer trains, dedicated rollout
    engines on its host that have nothing to generate lend it their cores (CoresLent:
    it runs more intra-op threads), taken back by the engine's next request. Pays where
    training is the bottleneck; off: each keeps its own cores."""

    switch_cost_prior_s: float = 1.0
    """Lend-in and reclaim time assumed until measured on this run (reported with each
    decision; the decision itself measures steps/s)."""

    reclaim_timeout_s: float = 10.0
    """Longest the trainer waits for a lent engine to release its slot; an engine that
    misses it is treated as gone (its heartbeats decide whether it is dead)."""

    lend_timeout_s: float = 120.0
    """Longest a lent engine may take to wake, catch up and serve before it counts as
    failed to lend."""

    dead_after_s: float = 5.0
    """A resource whose last heartbeat is older than this is declared dead."""

    check_interval_s: float = 0.5
    """How often liveness is checked."""

    def policy_config(self) -> PolicyConfig:
        return PolicyConfig(
            mode=self.mode,
            lend_margin=self.lend_margin,
            switch_cost_prior_s=self.switch_cost_prior_s,
            block_steps=self.lend_block_steps,
            lend_shares=self.lend_shares,
        )

    @model_validator(mode="after")
    def _check(self) -> Self:
        self.policy_config()  # raises on bad shares or block sizes
        if not 0 < self.reclaim_early_at <= 1:
            raise ValueError(f"reclaim_early_at must be in (0, 1], got {self.reclaim_early_at}")
        return self
