from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from seamlessflow.runfile import RunFileSettings, run_default
from sf_trajectory.data_filters import parse_filter_names
from sf_trajectory.schedule import StageSpec, parse_stages


class TrajectorySettings(RunFileSettings):
    """trajectory settings (env prefix ``SF_TRAJECTORY_``)."""

    model_config = SettingsConfigDict(
        env_prefix="SF_TRAJECTORY_", extra="ignore", use_attribute_docstrings=True
    )

    task: str = run_default("task")
    """Name of the task source (``seamlessflow.tasks``) the agents roll out (when no
    ``stages`` are set)."""

    stages: str = ""
    """SRPO's multi-stage schedule: comma-separated ``task:batches`` entries, the last one
    without a count, e.g. ``lookup:100,arithmetic`` = the task source ``lookup`` for
    batches 0-99 (the first 100 trainer steps), then ``arithmetic`` to the end of the run.
    The switch happens at a batch boundary; each stage scores with its source's reward
    function. Empty = one stage, ``task``."""

    group_size: int = run_default("group_size")
    """Samples per task: one GRPO group."""

    groups_per_batch: int = run_default("groups_per_batch")
    """Groups in one trainer batch (one optimizer step)."""

    data_filters: str = "staleness"
    """Data algorithms, comma-separated, in order (``sf_trajectory.data_filters``):
    ``staleness`` (drop samples older than ``max_staleness``), ``dynamic_sampling`` (drop
    groups whose rewards are all equal and dispatch a refill), ``history_resampling``
    (SRPO: at each epoch boundary drop the prompts whose rollouts were all correct).
    Group filters judge a group in this order; empty = none."""

    max_staleness: int = 4
    """Staleness bound (``staleness`` filter): a sample with a token generated more than
    this many versions before the version that will train it is dropped (reason
    ``stale``)."""

    dynamic_sampling_max_refills: int = 32
    """``dynamic_sampling``: at most this many zero-variance groups are dropped (and
    refilled) per batch; later ones are kept (``groups_waived``), so a run whose groups
    all agree still makes progress. 0 = count zero-variance groups but keep them."""

    history_correct_reward: float = 1.0
    """``history_resampling``: a rollout whose reward is at least this counts as correct."""

    reward_fns: str = ""
    """Dotted-path reward functions (``pkg.mod:fn``) a session may name, comma-separated,
    besides the registered ones and the stages' own. A session naming any other is
    scored by none (its sample is dropped, reason ``no_reward``): a session's
    ``reward_fn`` comes from whoever opened it, and the trajectory service runs it."""

    verify_concurrency: int = Field(default=16, ge=1, le=1024)
    """Task verifiers run at once (worker threads). A verifier that waits on something
    (a sandbox, a judge service) holds back only its own session's group: other groups'
    events go on being applied, and up to this many verifications overlap."""

    max_batches_ahead: int = run_default("max_batches_ahead")
    """Rollout rhythm: how many batches may be dispatched beyond what the trainer has
    consumed. 0 = synchronous (on-policy: each assignment names the version just
    published as its floor, and engines catch up to it before they answer); larger
    values overlap rollout and training at the cost of staleness (a sample is at most
    ``max_batches_ahead + 1`` versions old)."""

    group_timeout_s: float = run_default("group_timeout_s")
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

    @field_validator("stages")
    @classmethod
    def _valid_stages(cls, value: str) -> str:
        parse_stages(value)
        return value

    @field_validator("data_filters")
    @classmethod
    def _valid_data_filters(cls, value: str) -> str:
        parse_filter_names(value)
        return value

    def stage_specs(self) -> list[StageSpec]:
        return parse_stages(self.stages) or [StageSpec(task=self.task, batches=None)]

    def trusted_reward_fns(self) -> list[str]:
        return [name.strip() for name in self.reward_fns.split(",") if name.strip()]

    def data_filter_names(self) -> list[str]:
        return parse_filter_names(self.data_filters)
