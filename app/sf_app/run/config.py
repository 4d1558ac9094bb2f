"""What an embedded run does: its configuration and how its processes are laid out.

``RunConfig`` is the whole run as the CLI (``seamlessflow up``) sets it; every field maps
to one service setting (``sf_app.run.embedded.EmbeddedRun.service_env``). ``deployment``
turns a mode into tags and slots only: the three modes are one mechanism.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import ConfigDict, Field, field_validator, model_validator

from seamlessflow.protocol import DEFAULT_POLICY, check_policy
from seamlessflow.runfile import RunShared

BUILTIN_ENVS = ("guess_number",)
"""The environments ``sf_envs`` serves, by the name ``--env`` takes."""


def is_env_url(text: str) -> bool:
    return text.startswith(("http://", "https://"))


class RunConfig(RunShared):
    """What an embedded run does, declared once: ``seamlessflow up``'s options are its
    fields (``sf_app.cli``), and the run file's ``[run]`` keys. The values several
    processes use are the run's shared section (``RunShared``, inherited: declared and
    defaulted there, once); the others concern the embedded run only."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    run_id: str = ""
    """Run id (default: ``r<date>-<time>``)."""
    runs_dir: Path = Path("runs")
    """Where ``<run-id>/`` is written."""
    model_dir: Path | None = None
    """Base model directory (HF layout), used as it is; default: the built-in model,
    built once into the cache directory."""
    model: str = ""
    """A pretrained model by name (``seamlessflow.assets.pretrained``, e.g.
    ``smollm2-135m-instruct``), converted once into the cache directory from the package
    that ships it; empty (or ``built-in``): ``model_dir`` or the built-in model."""
    model_size: str = "small"
    """Size of the built-in model (``sf_app.base_model.MODEL_SIZES``):
    ``small`` (the task's recipe) or ``medium`` (~25M parameters, a warm-up scaled to it)."""
    cache_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow"))
    )
    """Cache for the built base model."""
    policies: list[str] = Field(default_factory=lambda: [DEFAULT_POLICY])  # type: ignore[assignment]
    """The policies trained together (multi-policy), each with its own trainer,
    weight-sync and engines; agents ask for them by model name. The first is the tasks'
    policy. Two policies go with a two-policy agent, e.g. ``solve_and_verify``."""
    eval_tasks: list[str] = Field(default_factory=list)
    """A policy's held-out evaluation when it is not the run's task, as ``POLICY=TASK``
    (several by comma): e.g. ``verifier=verify:arithmetic``, a verifier scored on its
    verdicts about a fixed solver's answers (``seamlessflow.tasks.verify``), not on
    answering the solver's questions. A policy not named evaluates on ``task``."""
    engines: int = 1
    """Engine worker processes."""
    gateways: int = Field(default=1, ge=1)
    """Gateway processes, all on the run's one gateway port (``SF_GATEWAY_REUSE_PORT``:
    the kernel spreads the agents' connections among them, and every one serves every
    session)."""
    max_restarts: int = 3
    """Supervision: a process that exits unexpectedly (a service, an engine, the agent
    runner, the embedded NATS server) is started again with the same command and
    settings, at most this many times per process; one more exit fails the run. A
    restarted trainer resumes from its latest checkpoint."""
    env: str = ""
    """An OpenEnv environment the agents play episodes in: the URL of a server you run
    (``http://host:port``), or the name of a built-in one (``guess_number``), which the
    run starts as its own process and restarts if it dies. Unless given, the agent
    becomes ``openenv`` and the task ``episodes`` (seeds of games)."""
    nats_url: str = ""
    """Use this NATS server (JetStream enabled), or several servers of one cluster
    separated by commas, instead of starting an embedded one."""
    nats_cluster: int = Field(default=1, ge=1, le=5)
    """NATS servers the run starts: 1, or a cluster of 3 (or 5) on loopback whose every
    stream and bucket has that many replicas (``SF_NATS_REPLICAS``), so the run survives
    the loss of a node."""
    live: bool = True
    """Show live progress in the terminal."""
    fork_server: bool = True
    """Start the run's processes (all but vLLM engines) by forking them from one
    interpreter that has imported torch, transformers and the services once, instead of
    a fresh interpreter each: the same code with the same settings, minus ~25 CPU-s of
    imports per run. Off: every process is ``python -m sf_app serve <service>``."""
    pin_slots: bool = False
    """Emulate slots as accelerators: pin each engine and the trainer to the CPU core of
    its slot (slot i -> core i mod cores), and the data plane (NATS, gateway, agents,
    trajectory, weight-sync, tag-scheduler) to slot 0's core, so a trainer's slot is
    really idle while it waits, as a GPU would be, instead of being filled by the
    operating system with other work. Used by the mode benchmark."""
    run_file: Path | None = None
    """The run file this run was started from (``--config``): copied into the run
    directory as ``run.toml``, from which every process reads its own section
    (``SF_CONFIG``). Its ``[run]`` table gave this configuration's values, below the
    options given on the command line."""
    report_to: list[str] = Field(default_factory=list)
    """Experiment tracking (``sf_app.tracking``): ``tensorboard``, ``wandb``, both, or
    ``all``; empty or ``none``: none. Fed by this run's metrics stream, in the runner."""

    @model_validator(mode="after")
    def _valid_policies(self) -> RunConfig:
        if not self.policies:
            raise ValueError("a run trains at least one policy")
        for name in self.policies:
            check_policy(name)
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"a policy is listed twice: {self.policies}")
        self.eval_task_of()  # each entry names a policy of the run, once
        return self

    def eval_task_of(self) -> dict[str, str]:
        """``eval_tasks`` by policy (a malformed entry is a ValueError naming it)."""
        by_policy: dict[str, str] = {}
        for entry in self.eval_tasks:
            policy, sep, task = (part.strip() for part in entry.partition("="))
            if not sep or not policy or not task:
                raise ValueError(f"eval_tasks: {entry!r} is not POLICY=TASK")
            if policy not in self.policies:
                raise ValueError(f"eval_tasks: {policy!r} is not a policy of the run "
                                 f"({', '.join(self.policies)})")  # fmt: skip
            if policy in by_policy:
                raise ValueError(f"eval_tasks: {policy!r} is given twice")
            by_policy[policy] = task
        return by_policy

    @model_validator(mode="after")
    def _one_broker_source(self) -> RunConfig:
        if self.nats_url and self.nats_cluster > 1:
            raise ValueError(
                "nats_cluster starts brokers and nats_url names others: give one of them"
            )
        if self.nats_cluster == 2 or self.nats_cluster == 4:
            raise ValueError("nats_cluster: 1, 3 or 5 (a JetStream quorum needs a majority)")
        return self

    @model_validator(mode="after")
    def _known_trackers(self) -> RunConfig:
        from sf_app.tracking import parse_report_to

        self.report_to = list(parse_report_to(self.report_to))
        return self

    @model_validator(mode="after")
    def _known_model_size(self) -> RunConfig:
        from sf_app.base_model import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise ValueError(
                f"unknown model size {self.model_size!r}; known sizes: {', '.join(MODEL_SIZES)}"
            )
        return self

    @field_validator("model")
    @classmethod
    def _built_in_is_none(cls, model: str) -> str:
        """``built-in`` names the built-in model (compose's ``SF_MODEL``): no pretrained."""
        from seamlessflow.assets.pretrained import BUILT_IN

        return "" if model == BUILT_IN else model

    @model_validator(mode="after")
    def _one_model(self) -> RunConfig:
        if self.model:
            from seamlessflow.assets.pretrained import PretrainedUnavailable, packaged_model

            try:
                packaged_model(self.model)
            except PretrainedUnavailable as exc:  # an unknown name, naming the known ones
                raise ValueError(str(exc)) from None
            if self.model_dir is not None:
                raise ValueError("give a pretrained model (model) or a directory (model_dir)")
        return self

    @model_validator(mode="after")
    def _environment_episodes(self) -> RunConfig:
        if not self.env:
            return self
        if not is_env_url(self.env) and self.env not in BUILTIN_ENVS:
            raise ValueError(
                f"env {self.env!r} is neither a URL (http://host:port) nor a built-in "
                f"environment ({', '.join(BUILTIN_ENVS)})"
            )
        given = self.model_fields_set
        if "agent" not in given:
            self.agent = "openenv"
        if "task" not in given:
            self.task = "episodes"
        if self.eval_every and self.task == "episodes":
            raise ValueError(
                "eval_every: the trainer's held-out evaluation answers single prompts; "
                "environment episodes have none (their returns are in the metrics)"
            )
        return self

    @property
    def builtin_env(self) -> str:
        """The built-in environment this run starts, or "" (none, or one given by URL)."""
        return self.env if self.env in BUILTIN_ENVS else ""

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> RunConfig:
        if self.mode == "colocated" and "max_batches_ahead" not in self.model_fields_set:
            self.max_batches_ahead = 0
        return self

    @model_validator(mode="after")
    def _model_and_task_defaults(self) -> RunConfig:
        """What the user left unset, filled in order: a pretrained model's own defaults
        (``PackagedModel.run_defaults``, chosen by measurement: docs/models.md; its task
        among them), then the task's completion budget (a task's ``max_tokens``), which
        wins over the model's."""
        given = set(self.model_fields_set)
        if self.model:
            from seamlessflow.assets.pretrained import packaged_model

            for name, value in packaged_model(self.model).run_defaults.items():
                if name not in given:
                    setattr(self, name, value)
        if "max_tokens" not in given:
            from seamlessflow.tasks import get_task_source
            from seamlessflow.tasks.schedule import schedule_sources

            budgets = []
            for task in schedule_sources(self.task):  # a schedule: each of its sources
                try:
                    source = get_task_source(task, seed=self.seed)
                except ImportError as exc:  # an optional extra the task needs: one line
                    raise ValueError(str(exc)) from None
                task_budget = getattr(source, "max_tokens", None)
                if task_budget is not None:
                    budgets.append(int(task_budget))
            if budgets:
                self.max_tokens = max(budgets)
        return self


@dataclass(frozen=True)
class EngineProcess:
    engine_id: str
    tags: str
    slot: str


@dataclass(frozen=True)
class Deployment:
    """Which process computes on which slot with which tags: the mode, as tags only.

    With ``engines = N`` every mode uses the same N + 1 slots (one core each here):

    - ``disaggregated``: engines 0..N-1 on slots 0..N-1 (``rollout``); the trainer
      alone on slot N (``train``), idle while it waits for a batch.
    - ``multiplexed``: the same, plus a lendable engine ``engine-lend-0`` on the
      trainer's slot N (``train,rollout``): it serves while the trainer waits.
    - ``auto``: laid out as ``multiplexed`` (the tag-scheduler lends when it pays)
      where the slots are real, else as ``disaggregated`` (``resolve_mode``).
    - ``colocated``: a lendable engine on every slot (``train,rollout``) and the trainer
      sharded over all N + 1 slots (one torch thread per slot); all engines step
      aside while it trains.
    """

    engines: list[EngineProcess]
    trainer_tags: str
    trainer_slots: list[str]

    @property
    def slots(self) -> list[str]:
        return sorted({e.slot for e in self.engines} | set(self.trainer_slots))


@dataclass(frozen=True)
class ModeChoice:
    """``--mode`` as this run lays it out: the requested mode, the deployment it gets
    (``deployment``'s mode) and why. The tag-scheduler runs the requested mode."""

    requested: str
    layout: str
    reason: str

    def line(self) -> str:
        if self.requested == self.layout:
            return f"mode {self.requested}"
        return f"mode {self.requested}: laid out {self.layout} ({self.reason})"

    def record(self) -> dict[str, str]:
        return {"requested": self.requested, "layout": self.layout, "reason": self.reason}


def resolve_mode(mode: str, *, pin_slots: bool, device: str) -> ModeChoice:
    """``auto`` puts a lendable engine on the trainer's slot only where that slot is
    real: an accelerator (``device`` not the CPU), or a CPU core the trainer has to
    itself (``pin_slots``). On unpinned CPU cores the operating system already gives a
    waiting trainer's core to the engines, so a lendable engine would only add a
    process (its start-up and its memory) for nothing to lend: ``auto`` is laid out as
    ``disaggregated`` there, and its scheduler, with nothing lendable, keeps the slots.
    Any other mode is laid out as itself."""
    if mode != "auto":
        return ModeChoice(mode, mode, "as requested")
    if device != "cpu":
        return ModeChoice(mode, "multiplexed", f"the trainer's slot is a {device} device")
    if pin_slots:
        return ModeChoice(mode, "multiplexed", "slots are pinned CPU cores")
    return ModeChoice(
        mode,
        "disaggregated",
        "unpinned CPU cores: the OS lends a waiting trainer's core already; "
        "--pin-slots to lend it by measurement",
    )


def deployment(mode: str, engines: int) -> Deployment:
    slots = [f"slot-{i}" for i in range(engines + 1)]
    train_slot = slots[-1]
    if mode == "colocated":
        return Deployment(
            [EngineProcess(f"engine-{i}", "train,rollout", slot) for i, slot in enumerate(slots)],
            "train,rollout",
            slots,
        )
    dedicated = [EngineProcess(f"engine-{i}", "rollout", slots[i]) for i in range(engines)]
    if mode in ("multiplexed", "auto"):
        dedicated.append(EngineProcess("engine-lend-0", "train,rollout", train_slot))
    return Deployment(dedicated, "train", [train_slot])


def is_users_model(model_dir: Path) -> bool:
    """A ``--model-dir`` with a config.json, or with any files and no trace of a
    built-in build (``build_info.json``), is the user's model: used as it is, after the
    check. A missing or empty one (or an unfinished build) gets the built-in model."""
    if (model_dir / "config.json").exists():
        return True
    if not model_dir.is_dir() or (model_dir / "build_info.json").exists():
        return False
    return any(model_dir.iterdir())


def default_run_id() -> str:
    return time.strftime("r%Y%m%d-%H%M%S", time.localtime()).lower()
