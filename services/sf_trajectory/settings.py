from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.plugins import ChosenFrom
from seamlessflow.runfile import RunFileSettings, shared
from sf_trajectory.data_filters import SETTINGS_VARIABLE, build_filters, parse_filter_names
from sf_trajectory.schedule import StageSpec, parse_stages

ENV_PREFIX = "SF_TRAJECTORY_"

RETIRED_FILTER_SETTINGS: dict[str, tuple[str, str]] = {
    "max_staleness": ("staleness", "max_staleness"),
    "dynamic_sampling_max_refills": ("dynamic_sampling", "max_refills"),
    "history_correct_reward": ("history_resampling", "correct_reward"),
}
"""Data-filter settings that were flat trajectory settings: old field -> (the filter, its
key). Set, they stop the service with the new spelling instead of being ignored."""


def retired_filter_setting(field: str) -> str:
    """The one line that refuses the flat filter setting ``field`` and names its new spelling."""
    name, key = RETIRED_FILTER_SETTINGS[field]
    return (
        f"{ENV_PREFIX}{field.upper()} ([trajectory] {field}) is no longer read: each data "
        f"filter carries its settings, set {SETTINGS_VARIABLE}__{name.upper()}__{key.upper()} "
        f"(or {key} under [trajectory.data_filter.{name}])"
    )


class TrajectorySettings(RunFileSettings):
    """trajectory settings (env prefix ``SF_TRAJECTORY_``)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="ignore",
        use_attribute_docstrings=True,
    )
    retired: ClassVar[Mapping[str, str]] = {
        field: retired_filter_setting(field) for field in RETIRED_FILTER_SETTINGS
    }

    task: str = shared("task")
    """What the agents roll out (when no ``stages`` are set): a task source
    (``seamlessflow.tasks``), a mixture of sources (``a*2+b``) or a whole schedule in the
    ``stages`` syntax (``a:100,a+b``: how ``seamlessflow up --task`` runs SRPO's stages)."""

    stages: str = ""
    """SRPO's multi-stage schedule (``seamlessflow.tasks.schedule``): comma-separated
    ``task:batches`` entries, the last one without a count, e.g. ``lookup:100,arithmetic``
    = the task source ``lookup`` for batches 0-99 (the first 100 trainer steps), then
    ``arithmetic`` to the end of the run. A stage may mix sources in stated proportions
    (``lookup:100,lookup*1+arithmetic*3``), each prompt scored by its own source's reward
    function. The switch happens at a batch boundary. Empty = ``task``'s schedule."""

    group_size: int = shared("group_size")
    """Samples per task: one GRPO group."""

    groups_per_batch: int = shared("groups_per_batch")
    """Groups in one trainer batch (one optimizer step)."""

    data_filters: Annotated[str, ChosenFrom("sf_trajectory.data_filters:DATA_FILTERS")] = (
        "staleness"
    )
    """Data algorithms, comma-separated, in order (``sf_trajectory.data_filters``): each a
    registered name or a dotted path (``package.module:Class``) to your own. Group
    filters judge a group in this order; empty = none."""

    data_filter: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each listed filter's own settings, under its name: ``[trajectory.data_filter.staleness]
    max_staleness = 2`` in the run file, ``SF_TRAJECTORY_DATA_FILTER__STALENESS__MAX_STALENESS=2``
    in the environment. The built-in filters' keys and their defaults are listed with
    the filters (``SF_TRAJECTORY_DATA_FILTERS``, docs/configuration.md's "Plug-ins"). A
    key the filter lacks, or keys for a filter not listed, stop the service."""

    reward_fns: str = ""
    """Dotted-path reward functions (``pkg.mod:fn``) a session may name, comma-separated,
    besides the registered ones and the stages' own. A session naming any other is
    scored by none (its sample is dropped, reason ``no_reward``): a session's
    ``reward_fn`` comes from whoever opened it, and the trajectory service runs it."""

    verify_concurrency: int = Field(default=16, ge=1, le=1024)
    """Task verifiers run at once (worker threads). A verifier that waits on something
    (a sandbox, a judge service) holds back only its own session's group: other groups'
    events go on being applied, and up to this many verifications overlap."""

    max_batches_ahead: int = shared("max_batches_ahead")
    """Rollout rhythm: how many batches may be dispatched beyond what the trainer has
    consumed. 0 = synchronous (on-policy: each assignment names the version just
    published as its floor, and engines catch up to it before they answer); larger
    values overlap rollout and training at the cost of staleness (a sample is at most
    ``max_batches_ahead + 1`` versions old)."""

    group_timeout_s: float = shared("group_timeout_s")
    """A group handed out to agents that makes no progress (no claim of one of its
    samples, no event of one of its sessions) for this long is closed: its unfinished
    samples are dropped (``timed_out``) and the group goes on with the samples it has,
    or is refilled if it has none. It catches sessions a restarted gateway lost and
    claims whose reply was lost; keep it above the longest pause of a healthy agent
    (its slowest turn, a wait for an engine)."""

    stall_timeouts: int = 2
    """The run is stalled, and this service exits with that error (exit code 78), when a
    group times out and no session of the run has finished for this many group
    time-outs (``group_timeout_s`` each): agents that cannot open sessions, engines that
    never answer. Groups lost to one fault (a gateway restart) time out together while
    other sessions finish, which is not a stall. 0: never."""

    @field_validator("stages", "task")
    @classmethod
    def _valid_stages(cls, value: str) -> str:
        parse_stages(value)
        return value

    @model_validator(mode="after")
    def _data_filters_build(self) -> TrajectorySettings:
        # every listed filter is found, takes its keys and is a filter, before any runs
        build_filters(self.data_filter_names(), self.data_filter)
        return self

    def stage_specs(self) -> list[StageSpec]:
        return parse_stages(self.stages or self.task)

    def trusted_reward_fns(self) -> list[str]:
        return [name.strip() for name in self.reward_fns.split(",") if name.strip()]

    def data_filter_names(self) -> list[str]:
        return parse_filter_names(self.data_filters)
