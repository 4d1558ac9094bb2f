"""Embedded local mode: a NATS server, every service as its own process, agents, a run.

``seamlessflow up`` calls :func:`run_embedded`. Each service is started exactly as it
would be deployed alone (``python -m seamlessflow serve <service>`` with env settings);
this module only wires environment variables, watches the processes (one that dies is
started again, within a budget: ``unexpected_exit``), shows progress and writes the run
report:

    runs/<run-id>/summary.json      the contract: see ``Summary``
    runs/<run-id>/metrics.jsonl     one TrainStepMetrics per line ("type":
                                    "train.metrics"), and with SF_TRAINER_EVAL_EVERY
                                    a TrainEvalMetrics ("train.eval") per evaluation
    runs/<run-id>/spans.jsonl       every process's spans (also per process in spans/)
    runs/<run-id>/checkpoints/final HF layout, loadable with from_pretrained (another
                                    policy than the first: checkpoints/<policy>/final)
    runs/<run-id>/reward_curve.png
    runs/<run-id>/timeline.html|png one lane per resource, bubbles marked
    runs/<run-id>/logs/<service>.log
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import nats.errors
from pydantic import BaseModel, Field, model_validator

from seamlessflow.bus import EXIT_UNRECOVERABLE, FOLLOW_HEARTBEAT_S, Unrecoverable, connect
from seamlessflow.connection import RunConnection
from seamlessflow.natsserver import EmbeddedNats
from seamlessflow.protocol import (
    DEFAULT_POLICY,
    Subjects,
    TrainEvalMetrics,
    TrainingFinished,
    TrainingPlanned,
    TrainStepMetrics,
    check_policy,
    decode,
)
from seamlessflow.service_table import SERVICE_TABLE
from seamlessflow.settings import MeshSettings, checkpoints_dir
from seamlessflow.tasks import task_names

log = logging.getLogger(__name__)

FINISH_GRACE_S = 30.0
"""How long a trainer that exited 0 has for its TrainingFinished to reach the run."""


class RunConfig(BaseModel):
    """What an embedded run does. Every field maps to one service setting."""

    run_id: str = ""
    """Run id (default: ``r<date>-<time>``)."""
    runs_dir: Path = Path("runs")
    """Where ``<run-id>/`` is written."""
    model_dir: Path | None = None
    """Base model directory (HF layout), used as it is; default: the built-in model,
    built once into the cache directory."""
    model_size: str = "small"
    """Size of the built-in model (``seamlessflow.assets.base_model.MODEL_SIZES``):
    ``small`` (the task's recipe) or ``medium`` (~25M parameters, a warm-up scaled to it)."""
    cache_dir: Path = Field(
        default_factory=lambda: Path(os.environ.get("SF_CACHE_DIR", "~/.cache/seamlessflow"))
    )
    """Cache for the built base model."""
    task: str = "arithmetic"
    """Task source (``seamlessflow.tasks``)."""
    agent: str = "single_turn"
    """Agent run for each sample (registered name or dotted path)."""
    policies: list[str] = Field(default_factory=lambda: [DEFAULT_POLICY])
    """The policies trained together (multi-policy), each with its own trainer,
    weight-sync and engines; agents ask for them by model name. The first is the tasks'
    policy. Two policies go with a two-policy agent, e.g. ``solve_and_verify``."""
    steps: int = 300
    """Trainer optimizer steps."""
    group_size: int = 8
    """Samples per task (GRPO group)."""
    groups_per_batch: int = 8
    """Tasks per optimizer step."""
    max_batches_ahead: int = 1
    """Rollout may run this many batches ahead of the trainer (0 = synchronous)."""
    max_tokens: int = 6
    """Completion budget per agent call (default: the task's ``max_tokens`` if it has
    one, e.g. room for a tool call; else 6)."""
    lr: float = 1e-4
    """Trainer learning rate."""
    engines: int = 1
    """Engine worker processes."""
    agent_concurrency: int = 64
    """Concurrent agent sessions."""
    engine_batch_size: int = 64
    """Requests one engine decodes together."""
    seed: int = 0
    """Seed for task order and the trainer."""
    max_restarts: int = 3
    """Supervision: a process that exits unexpectedly (a service, an engine, the agent
    runner, the embedded NATS server) is started again with the same command and
    settings, at most this many times per process; one more exit fails the run. A
    restarted trainer resumes from its latest checkpoint."""
    checkpoint_every: int = 10
    """The trainer also checkpoints every N steps (``SF_TRAINER_CHECKPOINT_EVERY``; 0 =
    only at the end): what a restarted trainer resumes from. The steps after it are
    lost to the policy (their batches stay trained once, see docs/design.md "Faults")."""
    group_timeout_s: float = 120.0
    """A group handed out to agents that makes no progress for this long is closed: its
    unfinished samples are dropped (``SF_TRAJECTORY_GROUP_TIMEOUT_S``; e.g. sessions a
    restarted gateway lost)."""
    nats_url: str = ""
    """Use this NATS server (JetStream enabled) instead of starting an embedded one."""
    mode: Literal["colocated", "disaggregated", "multiplexed"] = "disaggregated"
    """Deployment (see ``deployment``): which slots train, which roll out, which are
    lent. ``colocated`` also defaults ``max_batches_ahead`` to 0 (synchronous)."""
    live: bool = True
    """Show live progress in the terminal."""
    pin_slots: bool = False
    """Emulate slots as accelerators: pin each engine and the trainer to the CPU core of
    its slot (slot i -> core i mod cores), and the data plane (NATS, gateway, agents,
    trajectory, weight-sync, tag-scheduler) to slot 0's core, so a trainer's slot is
    really idle while it waits, as a GPU would be, instead of being filled by the
    operating system with other work. Used by the mode benchmark."""

    @model_validator(mode="after")
    def _valid_policies(self) -> RunConfig:
        if not self.policies:
            raise ValueError("a run trains at least one policy")
        for name in self.policies:
            check_policy(name)
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"a policy is listed twice: {self.policies}")
        return self

    @model_validator(mode="after")
    def _known_model_size(self) -> RunConfig:
        from seamlessflow.assets.base_model import MODEL_SIZES

        if self.model_size not in MODEL_SIZES:
            raise ValueError(
                f"unknown model size {self.model_size!r}; known sizes: {', '.join(MODEL_SIZES)}"
            )
        return self

    @model_validator(mode="after")
    def _colocated_is_synchronous(self) -> RunConfig:
        if self.mode == "colocated" and "max_batches_ahead" not in self.model_fields_set:
            self.max_batches_ahead = 0
        return self

    @model_validator(mode="after")
    def _task_max_tokens(self) -> RunConfig:
        if "max_tokens" not in self.model_fields_set:
            from seamlessflow.tasks import get_task_source

            task_budget = getattr(get_task_source(self.task, seed=self.seed), "max_tokens", None)
            if task_budget is not None:
                self.max_tokens = int(task_budget)
        return self


@dataclass
class Launch:
    """How one process of the run is started (and started again by supervision)."""

    service: str
    env: dict[str, str]
    slots: list[str]


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
    if mode == "multiplexed":
        dedicated.append(EngineProcess("engine-lend-0", "train,rollout", train_slot))
    return Deployment(dedicated, "train", [train_slot])


@dataclass
class Summary:
    """``summary.json``: read by tools and users. Field names are a contract."""

    run_id: str
    status: str
    steps: int
    reward_first: float | None
    reward_last: float | None
    tokens_generated: int
    tokens_trained: int
    wall_s: float
    final_version: int
    mode: str
    generated_tokens_per_s: float
    trained_tokens_per_s: float
    mean_step_s: float
    mean_wait_s: float
    mean_publish_s: float
    checkpoint: str | None
    bubble_ratio: float | None = None
    """Idle slot-time / total over the busy window (``seamlessflow.timeline``)."""
    steady_generated_tokens_per_s: float = 0.0
    """Generated tokens/s between the first and the last step (start-up excluded): the
    figure to compare modes by."""
    steady_seconds_per_step: float = 0.0
    """Mean time between consecutive steps (start-up excluded): with a fixed number of
    steps, the figure that does not depend on how long the answers were."""
    lends: int = 0
    """Engines lent to rollout from training slots (``sched.lend`` spans)."""
    reclaims: int = 0
    """Engines taken back for training (``sched.reclaim`` spans)."""
    requests_handed_back: int = 0
    """Requests in flight on reclaimed engines, resumed elsewhere (partial rollout)."""
    weights_bytes_sent: int = 0
    """Weight payload bytes over the run (per engine): fulls plus deltas."""
    weights_bytes_full: int = 0
    """What sending every version in full would have cost (``SF_WEIGHTS_DELTAS``)."""
    policies: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per policy: steps, reward_first, reward_last, final_version, tokens_trained,
    checkpoint. The fields above describe the first policy (the tasks' policy)."""
    restarts: dict[str, int] = field(default_factory=dict)
    """Supervision: how many times each process (by label; ``nats`` for the embedded
    server) was started again after an unexpected exit."""
    config: dict[str, Any] = field(default_factory=dict)


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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def window_mean(values: list[float], first: bool) -> float | None:
    """Mean over the first or last 10% of the values (at least one)."""
    if not values:
        return None
    n = max(1, len(values) // 10)
    chosen = values[:n] if first else values[-n:]
    return sum(chosen) / len(chosen)


class EmbeddedRun:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run_id = config.run_id or default_run_id()
        self.run_dir = (config.runs_dir / self.run_id).resolve()
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self.launches: dict[str, Launch] = {}
        """Label -> how its process was started: a restart starts it the same way."""
        self.restarts: dict[str, int] = {}
        self.nats_server: EmbeddedNats | None = None
        """The embedded server (None when the run uses ``nats_url``)."""
        self._clean_exits: dict[str, float] = {}
        """Trainers that exited 0 before their finish arrived: since when."""
        self.process_policy: dict[str, str] = {}
        """Label of a per-policy process -> its policy."""
        self.metrics_by_policy: dict[str, list[TrainStepMetrics]] = {
            policy: [] for policy in config.policies
        }
        self.finished_by_policy: dict[str, TrainingFinished] = {}
        self.status = "running"
        self.started = time.monotonic()
        self.started_wall = time.time()

    @property
    def metrics(self) -> list[TrainStepMetrics]:
        """The first policy's steps (the only policy of a single-policy run)."""
        return self.metrics_by_policy[self.config.policies[0]]

    @property
    def finished(self) -> TrainingFinished | None:
        return self.finished_by_policy.get(self.config.policies[0])

    @property
    def multi_policy(self) -> bool:
        return len(self.config.policies) > 1

    def label(self, policy: str, name: str) -> str:
        """A process's (or engine's, or slot's) name: prefixed by its policy when the
        run has several, so that every one is unique in the run."""
        return f"{policy}-{name}" if self.multi_policy else name

    # ---------------------------------------------------------------- processes

    def service_env(self, nats_url: str, model_dir: Path, gateway_port: int) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update(
            {
                "SF_NATS_URL": nats_url,
                "SF_RUN_ID": self.run_id,
                "SF_RUN_DIR": str(self.run_dir),
                "SF_MODEL_DIR": str(model_dir),
                "SF_POLICIES": ",".join(c.policies),
                "SF_SEED": str(c.seed),
                "SF_TAG_SCHEDULER_MODE": c.mode,
                "SF_TRAJECTORY_TASK": c.task,
                "SF_TRAJECTORY_GROUP_SIZE": str(c.group_size),
                "SF_TRAJECTORY_GROUPS_PER_BATCH": str(c.groups_per_batch),
                "SF_TRAJECTORY_MAX_BATCHES_AHEAD": str(c.max_batches_ahead),
                "SF_TRAJECTORY_GROUP_TIMEOUT_S": str(c.group_timeout_s),
                "SF_TRAINER_STEPS": str(c.steps),
                "SF_TRAINER_CHECKPOINT_EVERY": str(c.checkpoint_every),
                "SF_TRAINER_LR": str(c.lr),
                # what SF_TRAINER_EVAL_EVERY evaluates: the run's task, split as rolled out
                "SF_TRAINER_EVAL_TASK": c.task,
                "SF_TRAINER_EVAL_MAX_TOKENS": str(c.max_tokens),
                "SF_GATEWAY_PORT": str(gateway_port),
                "SF_ENGINE_MAX_BATCH_SIZE": str(c.engine_batch_size),
                "SF_AGENTS_GATEWAY_URL": f"http://127.0.0.1:{gateway_port}",
                "SF_AGENTS_AGENT": c.agent,
                "SF_AGENTS_CONCURRENCY": str(c.agent_concurrency),
                "SF_AGENTS_MAX_TOKENS": str(c.max_tokens),
                # each process uses one core; several share the machine
                "OMP_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        # what a restarted trainer resumes from is the latest; keep one more (unless the
        # user's environment says otherwise)
        env.setdefault("SF_TRAINER_KEEP_CHECKPOINTS", "2")
        return env

    def spawn(
        self, label: str, service: str, env: dict[str, str], slots: list[str] | None = None
    ) -> None:
        self.launches[label] = Launch(service, env, slots or ["slot-0"])
        self._start(label)

    def _start(self, label: str) -> None:
        launch = self.launches[label]
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with (logs / f"{label}.log").open("ab") as out:
            self.processes[label] = process = subprocess.Popen(
                [sys.executable, "-m", "seamlessflow", "serve", launch.service],
                env=launch.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the runner, which stops us in order
            )
        self.pin(process.pid, launch.slots)

    def pin(self, pid: int, slots: list[str]) -> None:
        """``pin_slots``: run ``pid`` on the cores of ``slots`` (``slot-<i>``)."""
        if not self.config.pin_slots or not hasattr(os, "sched_setaffinity"):
            return
        cores = os.cpu_count() or 1
        os.sched_setaffinity(pid, {int(slot.rsplit("-", 1)[1]) % cores for slot in slots})

    def stop_processes(self, timeout: float = 30.0) -> None:
        """Stop in dependency order (``ServiceSpec.stop_stage``), each stage draining
        before the next one stops: agents, then the gateway, then engines, then the rest
        (the trainer saves its checkpoint). SIGKILL whatever misses its deadline.
        Idempotent."""

        def service_of(label: str) -> str:
            policy = self.process_policy.get(label)
            name = label.removeprefix(f"{policy}-") if policy and self.multi_policy else label
            return "engine" if name.startswith("engine-") else name

        stages = [
            {spec.name for spec in SERVICE_TABLE if spec.stop_stage == stage}
            for stage in sorted({spec.stop_stage for spec in SERVICE_TABLE})
        ]
        for stage in stages:
            running = [
                (label, p) for label, p in self.processes.items() if service_of(label) in stage
            ]
            for _, process in running:
                if process.poll() is None:
                    process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for label, process in running:
                try:
                    process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop in time; killing it", label)
                    process.kill()
                    process.wait()

    def unexpected_exits(self) -> list[tuple[str, int]]:
        """``(label, exit code)`` of every process that ended but should still run.
        Normal ends: the agent runner with 0 (tasks exhausted), a trainer with 0 once
        its policy finished. A trainer exits 0 right after it announces the finish,
        which may reach this run a little later (e.g. while the run's connection to a
        restarted NATS server recovers): it has ``FINISH_GRACE_S`` to arrive."""
        ended = []
        now = time.monotonic()
        for label, process in self.processes.items():
            code = process.poll()
            if code is None:
                continue
            if label == "agents" and code == 0:
                continue
            policy = self.process_policy.get(label, "")
            if label == self.label(policy, "trainer") and code == 0:
                if policy in self.finished_by_policy:
                    continue
                if now - self._clean_exits.setdefault(label, now) < FINISH_GRACE_S:
                    continue
            ended.append((label, code))
        return ended

    def unexpected_exit(self) -> str | None:
        """Supervision, polled while the run goes on: start again what ended unexpectedly
        (the embedded NATS server in place: same port, same store), within
        ``max_restarts`` per process. Past the budget: what failed, and the run fails."""
        budget = self.config.max_restarts
        nats_server = self.nats_server
        if nats_server is not None and nats_server.process is not None:
            code = nats_server.process.poll()
            if code is not None:
                if self.restarts.get("nats", 0) >= budget:
                    return f"nats-server exited with code {code} after {budget} restarts"
                self._count_restart("nats", code)
                nats_server.restart()
                self.pin(nats_server.process.pid, ["slot-0"])
        for label, code in self.unexpected_exits():
            if code == EXIT_UNRECOVERABLE:  # a restart would fail the same way
                return f"{label}: {self.last_log_line(label)}"
            if self.restarts.get(label, 0) >= budget:
                return (
                    f"{label} exited with code {code} after {budget} restarts "
                    f"(see {self.run_dir}/logs/{label}.log)"
                )
            self._count_restart(label, code)
            self._clean_exits.pop(label, None)
            launch = self.launches[label]
            if launch.service == "trainer":
                # from its latest checkpoint, numbering versions after the announced ones
                launch.env = {**launch.env, "SF_TRAINER_RESUME": "latest"}
            self._start(label)
        return None

    def last_log_line(self, label: str) -> str:
        """The last line a process wrote (an unrecoverable failure's one line)."""
        log_file = self.run_dir / "logs" / f"{label}.log"
        lines = log_file.read_text(errors="replace").strip().splitlines()
        return lines[-1].removeprefix(f"{self.launches[label].service}: ") if lines else ""

    def _count_restart(self, label: str, code: int) -> None:
        self.restarts[label] = self.restarts.get(label, 0) + 1
        log.warning(
            "%s exited with code %d: restart %d of %d",
            label, code, self.restarts[label], self.config.max_restarts,
        )  # fmt: skip

    # ---------------------------------------------------------------- the run

    async def run(self) -> Summary:
        from seamlessflow.assets.base_model import built_model_name, ensure_base_model, sized_config

        c = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if c.model_dir is not None and is_users_model(c.model_dir):
            model_dir = c.model_dir  # the user's model, used as it is
            problem = await asyncio.to_thread(self.check_users_model, model_dir)
            if problem:
                # before any process starts: one line, all of it, as the run's status
                self.status = f"failed: {problem}"
                log.error("%s", problem)
                return self.write_report()
        else:
            # The built-in model is warmed up on a built-in task; a data file (or any other
            # task without a teacher) gets the arithmetic one: bring a real model for it.
            warmup_task = c.task if c.task in task_names() else "arithmetic"
            if warmup_task != c.task and c.model_dir is None:
                log.warning(
                    "task %s has no built-in warm-up: using the %s base model; pass "
                    "--model-dir for a model that can solve it",
                    c.task,
                    warmup_task,
                )
            cached = (
                c.cache_dir.expanduser() / "models" / built_model_name(warmup_task, c.model_size)
            )
            model_dir = await asyncio.to_thread(
                ensure_base_model,
                c.model_dir or cached,
                task=warmup_task,
                config=sized_config(warmup_task, c.model_size),
            )
        # Credentials of this run, made here and handed to the processes in their
        # environment only: the embedded NATS server takes a token, the gateway an
        # operator key (the agent runner's); neither is written to the run directory.
        nats_token = MeshSettings().nats_token.get_secret_value()
        if not c.nats_url:
            nats_token = secrets.token_urlsafe(24)
        self.nats_token = nats_token
        self.gateway_key = ""
        """The gateway's operator key this run made (the agent runner's), if it made one."""
        nats_server = EmbeddedNats(self.run_dir / "nats", token=nats_token)
        if not c.nats_url:
            self.nats_server = nats_server
        url = c.nats_url or nats_server.start()
        if nats_server.process is not None:
            self.pin(nats_server.process.pid, ["slot-0"])
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        try:
            gateway_port = free_port()
            env = self.service_env(url, model_dir, gateway_port)
            env["SF_NATS_TOKEN"] = nats_token
            if not env.get("SF_AGENTS_GATEWAY_KEY"):
                # The agent runner's own operator key, beside the user's keys (if any):
                # the user's agents open sessions with theirs, the runner with this one.
                self.gateway_key = secrets.token_urlsafe(24)
                user_keys = env.get("SF_GATEWAY_API_KEYS", "")
                env["SF_GATEWAY_API_KEYS"] = ",".join(filter(None, [user_keys, self.gateway_key]))
                env["SF_AGENTS_GATEWAY_KEY"] = self.gateway_key
            self.connection = RunConnection(
                run_id=self.run_id,
                nats_url=url,
                nats_token=nats_token,
                gateway_url=f"http://127.0.0.1:{gateway_port}",
                gateway_key=env["SF_AGENTS_GATEWAY_KEY"],
            )
            self.connection.write(self.run_dir)
            # stderr: stdout is for results (`seamlessflow bench` prints its JSON there)
            print(self.connection.attach_instructions(self.run_dir), file=sys.stderr, flush=True)
            # in the table's order; the agents last, once the mesh they use is up
            for spec in SERVICE_TABLE:
                if spec.name == "agents":
                    continue
                if not spec.per_policy:
                    self.spawn(spec.name, spec.name, env)
                    continue
                for policy in c.policies:
                    self.spawn_for_policy(policy, spec.name, env)
            self.spawn("agents", "agents", env)
            await self._follow(url, stop)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
            loop.remove_signal_handler(signal.SIGTERM)
            # Stopping the services in order takes a while: a supervisor's second SIGTERM
            # must not kill this runner with the default action and leave them running
            # (they are in their own sessions). A second Ctrl-C still interrupts. The
            # previous disposition comes back after (a run inside another program).
            previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                await asyncio.to_thread(self.stop_processes)
            finally:
                signal.signal(signal.SIGTERM, previous)
            nats_server.stop()
        return self.write_report()

    def check_users_model(self, model_dir: Path) -> str | None:
        """What the model lacks for this run (every service's needs, and a context for
        the task's longest prompt plus ``max_tokens``), as one line; None if usable."""
        from seamlessflow.assets.model_check import (
            ModelNeeds,
            ModelUnfit,
            check_model,
            task_context_tokens,
        )

        c = self.config
        context = task_context_tokens(model_dir, c.task, c.seed, c.max_tokens) or 0
        needs = ModelNeeds(
            # the engines' backend comes from the environment, as their processes read it
            backend=os.environ.get("SF_ENGINE_BACKEND", "hf"),
            context_tokens=context,
            context_reason=f"the longest {c.task} prompt + max_tokens {c.max_tokens}",
        )
        try:
            check_model(model_dir, needs)
        except ModelUnfit as exc:
            return str(exc)
        return None

    def spawn_for_policy(self, policy: str, service: str, run_env: dict[str, str]) -> None:
        """One policy's weight-sync, trainer or engines, laid out by the mode."""
        layout = deployment(self.config.mode, self.config.engines)
        # with SF_WEIGHTS_GROUP_BACKEND set, every engine joins its trainer's push group
        env = {
            **run_env,
            "SF_POLICY": policy,
            "SF_WEIGHTS_GROUP_SIZE": str(1 + len(layout.engines)),
        }

        def slot(name: str) -> str:
            return self.label(policy, name)

        if service == "engine":
            for rank, engine in enumerate(layout.engines, start=1):
                engine_id = self.label(policy, engine.engine_id)
                self.process_policy[engine_id] = policy
                self.spawn(
                    engine_id,
                    "engine",
                    {
                        **env,
                        "SF_ENGINE_ENGINE_ID": engine_id,
                        "SF_RESOURCE_TAGS": engine.tags,
                        "SF_RESOURCE_SLOTS": slot(engine.slot),
                        "SF_WEIGHTS_GROUP_RANK": str(rank),  # the trainer is 0
                    },
                    [slot(engine.slot)],
                )
            return
        label = self.label(policy, service)
        self.process_policy[label] = policy
        if service == "trainer":
            trainer_slots = [slot(s) for s in layout.trainer_slots]
            env = {
                **env,
                "SF_RESOURCE_TAGS": layout.trainer_tags,
                "SF_RESOURCE_SLOTS": ",".join(trainer_slots),
                "SF_TRAINER_TORCH_THREADS": str(len(trainer_slots)),
            }
            self.spawn(label, service, env, trainer_slots)
        else:
            self.spawn(label, service, env)

    async def _follow(self, url: str, stop: asyncio.Event) -> None:
        subjects = Subjects(self.run_id)
        try:
            follower = await connect(url, subjects, name="seamlessflow-up", token=self.nats_token)
        except Unrecoverable as exc:
            self.status = f"failed: {exc}"
            log.error("%s", exc)
            return
        nc = follower.nc
        metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        progress = Progress(self.config, self.run_id, enabled=self.config.live)
        try:
            js = nc.jetstream()
            problem = await self._wait_for_stream(js, subjects.stream_metrics(), stop)
            if problem:
                self.status = f"failed: {problem}"
                log.error(problem)
                return
            sub = await js.subscribe(
                subjects.train_all(),
                stream=subjects.stream_metrics(),
                ordered_consumer=True,
                idle_heartbeat=FOLLOW_HEARTBEAT_S,  # back within seconds of a NATS restart
            )
            with progress:
                while not stop.is_set():
                    problem = self.unexpected_exit()
                    if problem:
                        self.status = f"failed: {problem}"
                        progress.tick(self)  # the live table shows why, as its caption
                        log.error(problem)
                        return
                    try:
                        msg = await sub.next_msg(timeout=0.5)
                    except nats.errors.TimeoutError:
                        progress.tick(self)
                        continue
                    message = decode(
                        msg.data,
                        TrainStepMetrics | TrainEvalMetrics | TrainingFinished | TrainingPlanned,
                    )
                    if message.policy not in self.metrics_by_policy:
                        continue  # not a policy of this run's configuration
                    if isinstance(message, TrainingPlanned):
                        continue  # the trainer's budget: the run's own configuration
                    if isinstance(message, TrainEvalMetrics):
                        metrics_file.write(json.dumps(_struct_dict(message)) + "\n")
                        metrics_file.flush()
                        continue
                    if isinstance(message, TrainingFinished):
                        self.finished_by_policy[message.policy] = message
                        if len(self.finished_by_policy) == len(self.config.policies):
                            self.status = "finished"
                            return
                        continue
                    self.metrics_by_policy[message.policy].append(message)
                    metrics_file.write(json.dumps(_struct_dict(message)) + "\n")
                    metrics_file.flush()
                    progress.update(self, message.policy)
            self.status = "interrupted"
        finally:
            metrics_file.close()
            await nc.close()

    async def _wait_for_stream(self, js: Any, name: str, stop: asyncio.Event) -> str | None:
        """Wait until a service created the run's streams; a crashed service is returned."""
        import nats.js.errors

        while not stop.is_set():
            try:
                await js.stream_info(name)
                return None
            except nats.js.errors.NotFoundError:
                problem = self.unexpected_exit()
                if problem:
                    return problem
                await asyncio.sleep(0.2)
        return None

    # ---------------------------------------------------------------- the report

    def write_report(self) -> Summary:
        spans = self.run_dir / "spans"
        with (self.run_dir / "spans.jsonl").open("wb") as merged:
            for part in sorted(spans.glob("*.jsonl")) if spans.exists() else []:
                merged.write(part.read_bytes())
        bubble_ratio = None
        if (self.run_dir / "spans.jsonl").stat().st_size:
            from seamlessflow.timeline import render_run

            bubble_ratio = round(render_run(self.run_dir).bubble_ratio, 4)
        scheduling = count_scheduling(self.run_dir / "spans.jsonl")
        steady_window = (
            self.metrics[-1].timestamp - self.metrics[0].timestamp if self.metrics else 0
        )
        steady_tokens = sum(m.tokens_generated for m in self.metrics[1:])
        rewards = [m.mean_reward for m in self.metrics]
        train_wall = (self.metrics[-1].timestamp - self.started_wall) if self.metrics else 0.0
        generated = sum(m.tokens_generated for m in self.metrics)
        trained = sum(m.tokens_trained for m in self.metrics)
        checkpoint = self.checkpoint_of(self.config.policies[0])
        n = max(len(self.metrics), 1)
        summary = Summary(
            run_id=self.run_id,
            status=self.status,
            steps=len(self.metrics),
            reward_first=window_mean(rewards, first=True),
            reward_last=window_mean(rewards, first=False),
            tokens_generated=generated,
            tokens_trained=trained,
            wall_s=round(time.monotonic() - self.started, 3),
            final_version=self.metrics[-1].version if self.metrics else 0,
            mode=self.config.mode,
            generated_tokens_per_s=generated / train_wall if train_wall > 0 else 0.0,
            trained_tokens_per_s=trained / train_wall if train_wall > 0 else 0.0,
            mean_step_s=sum(m.step_seconds for m in self.metrics) / n,
            mean_wait_s=sum(m.wait_seconds for m in self.metrics) / n,
            mean_publish_s=sum(m.publish_seconds for m in self.metrics) / n,
            weights_bytes_sent=sum(m.weights_payload_bytes for m in self.metrics),
            weights_bytes_full=sum(m.weights_state_bytes for m in self.metrics),
            checkpoint=checkpoint,
            bubble_ratio=bubble_ratio,
            steady_generated_tokens_per_s=steady_tokens / steady_window if steady_window > 0 else 0,
            steady_seconds_per_step=steady_window / (len(self.metrics) - 1)
            if len(self.metrics) > 1
            else 0.0,
            lends=scheduling["lends"],
            reclaims=scheduling["reclaims"],
            requests_handed_back=scheduling["handed_back"],
            policies={policy: self.policy_summary(policy) for policy in self.config.policies},
            restarts=dict(self.restarts),
            config=json.loads(self.config.model_dump_json()),
        )
        (self.run_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
        if any(self.metrics_by_policy.values()):
            plot_rewards(self.metrics_by_policy, self.run_dir / "reward_curve.png", self.run_id)
        return summary

    def checkpoint_of(self, policy: str) -> str | None:
        """The policy's final checkpoint, if the trainer wrote one."""
        final = checkpoints_dir(self.run_dir, policy) / "final"
        return str(final) if (final / "config.json").exists() else None

    def policy_summary(self, policy: str) -> dict[str, Any]:
        metrics = self.metrics_by_policy[policy]
        rewards = [m.mean_reward for m in metrics]
        return {
            "steps": len(metrics),
            "finished": policy in self.finished_by_policy,
            "reward_first": window_mean(rewards, first=True),
            "reward_last": window_mean(rewards, first=False),
            "final_version": metrics[-1].version if metrics else 0,
            "tokens_generated": sum(m.tokens_generated for m in metrics),
            "tokens_trained": sum(m.tokens_trained for m in metrics),
            "checkpoint": self.checkpoint_of(policy),
        }


def count_scheduling(spans_path: Path) -> dict[str, int]:
    """Lends, reclaims and handed-back requests, from the tag-scheduler's spans."""
    counts = {"lends": 0, "reclaims": 0, "handed_back": 0}
    if not spans_path.exists():
        return counts
    with spans_path.open() as lines:
        for line in lines:
            span = json.loads(line)
            attributes = span["attributes"]
            if span["name"] == "sched.lend":
                counts["lends"] += len(attributes.get("lent", []))
            elif span["name"] == "sched.reclaim":
                counts["reclaims"] += len(attributes.get("reclaimed", []))
                counts["handed_back"] += int(attributes.get("handed_back", 0))
    return counts


def _struct_dict(message: TrainStepMetrics | TrainEvalMetrics) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(message)


def plot_rewards(
    metrics_by_policy: dict[str, list[TrainStepMetrics]], path: Path, title: str
) -> None:
    """One curve (per-step mean and its moving mean) per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    several = len(metrics_by_policy) > 1
    for policy, metrics in metrics_by_policy.items():
        steps = [m.step for m in metrics]
        rewards = [m.mean_reward for m in metrics]
        window = max(1, len(rewards) // 10)
        smooth = [
            sum(rewards[max(0, i - window + 1) : i + 1])
            / len(rewards[max(0, i - window + 1) : i + 1])
            for i in range(len(rewards))
        ]
        name = f"{policy}: " if several else ""
        ax.plot(steps, rewards, alpha=0.4, label=f"{name}mean reward per step")
        ax.plot(steps, smooth, label=f"{name}moving mean ({window} steps)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"reward curve: {title}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


class Progress:
    """Live terminal progress: step, mean reward, tokens/s, weight version."""

    def __init__(self, config: RunConfig, run_id: str, *, enabled: bool) -> None:
        self.config = config
        self.run_id = run_id
        self.enabled = enabled
        self._live: Any = None

    def __enter__(self) -> Progress:
        if self.enabled:
            from rich.live import Live

            self._live = Live(self._render(None), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def tick(self, run: EmbeddedRun) -> None:
        if self._live is not None:
            self._live.update(self._render(run))

    def update(self, run: EmbeddedRun, policy: str) -> None:
        self.tick(run)
        metrics = run.metrics_by_policy[policy]
        if not self.enabled and metrics:
            m = metrics[-1]
            name = f"{policy} " if run.multi_policy else ""
            log.info("%sstep %d reward %.3f version %d", name, m.step, m.mean_reward, m.version)

    def _render(self, run: EmbeddedRun | None) -> Any:
        from rich.table import Table

        table = Table(title=f"seamlessflow run {self.run_id}", show_header=True)
        columns = ("step", "mean reward", "last-10 reward", "gen tok/s", "version", "elapsed")
        several = len(self.config.policies) > 1
        for column in ("policy", *columns) if several else columns:
            table.add_column(column, justify="right")
        for policy in self.config.policies:
            row = self._row(run, policy)
            table.add_row(*((policy, *row) if several else row))
        if run is not None and run.status.startswith("failed"):
            table.caption = f"[bold red]{run.status}"
        return table

    def _row(self, run: EmbeddedRun | None, policy: str) -> tuple[str, ...]:
        metrics = run.metrics_by_policy[policy] if run is not None else []
        if run is None or not metrics:
            waited = f"{time.monotonic() - run.started:.0f}s" if run else "0s"
            return (f"0/{self.config.steps}", "-", "-", "-", "0", waited)
        m = metrics[-1]
        recent = metrics[-10:]
        elapsed = time.time() - run.started_wall
        generated = sum(x.tokens_generated for x in metrics)
        return (
            f"{m.step}/{self.config.steps}",
            f"{m.mean_reward:.3f}",
            f"{sum(x.mean_reward for x in recent) / len(recent):.3f}",
            f"{generated / elapsed:.0f}",
            str(m.version),
            f"{elapsed:.0f}s",
        )


def run_embedded(config: RunConfig) -> Summary:
    import uvloop

    run = EmbeddedRun(config)
    with contextlib.suppress(KeyboardInterrupt):
        return uvloop.run(run.run())
    return run.write_report()
