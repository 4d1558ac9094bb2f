"""Embedded local mode: a NATS server, every service as its own process, agents, a run.

``seamlessflow up`` calls :func:`run_embedded`. This module wires each service's
settings into its environment (one ``RunConfig`` field, one setting), lays the processes
out by the mode (``sf_app.run.config.deployment``), starts them under supervision
(``sf_app.run.supervisor``), follows the trainers' metrics stream and ends with the
report (``sf_app.run.report``):

    runs/<run-id>/summary.json      the contract: see ``Summary``
    runs/<run-id>/metrics.jsonl     one TrainStepMetrics per line ("type":
                                    "train.metrics"), and with SF_EVAL_EVERY
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
import shutil
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from seamlessflow.bus import (
    BROKER_ERRORS,
    BrokerUnavailable,
    Bus,
    Unrecoverable,
    connect,
    next_message,
)
from seamlessflow.connection import RunConnection
from seamlessflow.machine import cpu_computes_bf16, cpu_isa, resolve_precision, usable_cores
from seamlessflow.natsserver import EmbeddedNats, embedded_cluster
from seamlessflow.protocol import (
    BatchFilterReport,
    EpochFilterReport,
    Subjects,
    TrainEvalMetrics,
    TrainingFinished,
    TrainingPlanned,
    TrainProgress,
    decode,
)
from seamlessflow.runfile import RUN_FILE_VARIABLE, RunShared, shared_variable, variable
from seamlessflow.settings import MeshSettings
from seamlessflow.tasks import task_names
from seamlessflow.weights.settings import WeightTransferSettings
from sf_agents.settings import AgentRunnerSettings
from sf_app.run.config import (
    RunConfig,
    default_run_id,
    deployment,
    is_users_model,
    resolve_mode,
)
from sf_app.run.report import Progress, RunState, Summary, struct_dict, write_report
from sf_app.run.spec import resolved_sections, write_resolved
from sf_app.run.supervisor import Supervisor, fork_server_for, free_port
from sf_app.service_table import SERVICE_TABLE, settings_classes
from sf_app.tracking import Tracker
from sf_engine.settings import BACKEND_SETTINGS, EngineSettings, VllmSettings
from sf_envs.settings import EnvServerSettings
from sf_gateway.settings import GatewaySettings
from sf_trainer.settings import TrainerSettings

log = logging.getLogger(__name__)

RESOLVED_FILE = "run.toml"
"""The run's resolved specification in the run directory (``sf_app.run.spec``): every
process reads its own section of it (``SF_CONFIG``)."""
RUN_FILE_COPY = "run-file.toml"
"""The run file the run was started from (``--config``), as it was, beside it."""

MESH, TRAINER, ENGINE, VLLM = MeshSettings, TrainerSettings, EngineSettings, VllmSettings
GATEWAY, AGENTS, ENV, WEIGHTS = (
    GatewaySettings,
    AgentRunnerSettings,
    EnvServerSettings,
    WeightTransferSettings,
)


JETSTREAM_READY_S = 60.0
"""How long a new embedded cluster may take to elect its JetStream leader."""
ENV_READY_S = 60.0
"""How long the agents wait for the built-in environment server to listen."""
GATEWAYS_READY_S = 180.0
"""With several gateway processes: how long the agents wait for every one to listen."""


async def wait_for_jetstream(url: str, token: str) -> None:
    """Until JetStream answers on ``url`` (a new cluster elects its meta leader first);
    fails the run with one line after ``JETSTREAM_READY_S``."""
    bus = await connect(url, Subjects("probe"), name="seamlessflow-up", token=token)
    try:
        await bus.wait_for_jetstream(JETSTREAM_READY_S)
    finally:
        await bus.drain()


PROCESS_DEFAULTS = {
    # each process uses one core; several share the machine
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
"""What every process of the run has in its environment beside the caller's variables
and the ``SF_`` settings (these are read at import: the fork server is started with them)."""


RUN_SETS_VARIABLES = (
    (MESH, "nats_url"),
    (MESH, "run_id"),
    (MESH, "run_dir"),
    (MESH, "model_dir"),
    (GATEWAY, "port"),
    (AGENTS, "gateway_url"),
    (ENV, "seed"),
    (MESH, "policy"),
    (TRAINER, "eval_task"),
)
"""Variables of the caller that would override what the run sets for all its processes
(``EmbeddedRun.run_sets``) or for one (its policy, its evaluation task): not passed on.
The others pass on: set in the caller's environment, a setting wins over the file."""


class EmbeddedRun(Supervisor):
    """One embedded run: its processes (``Supervisor``), what it has seen (``state``)."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.run_id = config.run_id or default_run_id()
        self.run_dir = (config.runs_dir / self.run_id).resolve()
        super().__init__(
            self.run_dir,
            policies=config.policies,
            max_restarts=config.max_restarts,
            pin_slots=config.pin_slots,
            fork_server=config.fork_server,
        )
        self.state = RunState(
            config=config,
            run_id=self.run_id,
            run_dir=self.run_dir,
            metrics_by_policy={policy: [] for policy in config.policies},
            restarts=self.restarts,
            process_memory=self.memory.figures,
        )
        self.precision = resolve_precision(config.precision, trainer_device())
        """``--precision`` resolved for this machine (``auto``: from the hardware), as
        the trainer resolves it by the same rule on the same device: what the run
        prints and records."""
        self.state.precision = self.precision
        self.mode = resolve_mode(config.mode, pin_slots=config.pin_slots, device=trainer_device())
        """``--mode`` as this run lays it out (``auto``: from the slots it has)."""
        self.state.mode_choice = self.mode.record()
        self.state.hardware = {
            "cpu_isa": cpu_isa(),
            "cpu_bf16": cpu_computes_bf16(),
            "cores": usable_cores(),
            "trainer_device": trainer_device(),
        }
        self.nats_token = ""
        self.tracker = Tracker((), run_dir=self.run_dir, run_id=self.run_id, policies=[], config={})
        """Experiment tracking (``--report-to``), started with the run."""
        self.gateway_key = ""
        """The gateway's operator key this run made (the agent runner's), if it made one."""

    # ---------------------------------------------------------------- processes

    def run_sets(self, nats_url: str, model_dir: Path, gateway_port: int) -> dict[str, dict]:
        """What this run decides in the resolved file beside the shared section, by
        section: where the run is (its id, directory, broker, model, gateway)."""
        return {
            "mesh": {
                "nats_url": nats_url,
                "run_id": self.run_id,
                "run_dir": str(self.run_dir),
                "model_dir": str(model_dir),
            },
            "gateway": {"port": gateway_port},
            "agents": {"gateway_url": f"http://127.0.0.1:{gateway_port}"},
            "env": {"seed": self.config.seed},
        }

    @staticmethod
    def run_defaults(model_dir: Path) -> dict[str, dict]:
        """What an embedded run keeps unless its run file says otherwise: one more
        checkpoint than the latest (what a restarted trainer resumes from), and weights
        through the trainer's device memory or shared memory, as this host allows
        (``local_weight_transport``)."""
        return {
            "trainer": {"keep_checkpoints": 2},
            "weights": local_weight_transport(model_dir, trainer_device(), engine_device()),
        }

    def write_spec(self, nats_url: str, model_dir: Path, gateway_port: int) -> Path:
        """Resolve the run once and write it into the run directory (``RESOLVED_FILE``)."""
        sections = resolved_sections(
            self.config,
            settings_classes(),
            run_sets=self.run_sets(nats_url, model_dir, gateway_port),
            run_defaults=self.run_defaults(model_dir),
        )
        return write_resolved(self.run_dir / RESOLVED_FILE, sections)

    def service_env(self, spec_path: Path) -> dict[str, str]:
        """Every process's environment: the caller's, less what the resolved file says
        (the shared variables and what the run sets: the file is their one source), with
        ``SF_CONFIG`` naming the file."""
        env = dict(os.environ)
        for key in RunShared.model_fields:
            env.pop(shared_variable(key), None)
        for cls, field in RUN_SETS_VARIABLES:
            env.pop(variable(cls, field), None)
        env[RUN_FILE_VARIABLE] = str(spec_path)
        env.update(PROCESS_DEFAULTS)
        return env

    # ---------------------------------------------------------------- the run

    async def run(self) -> Summary:
        from seamlessflow.assets.pretrained import ensure_pretrained
        from sf_app.base_model import built_model_name, ensure_base_model, sized_config

        c = self.config
        # first: what this machine made the run choose (stderr, as the lines below)
        print(self.precision.line(), file=sys.stderr, flush=True)
        print(self.mode.line(), file=sys.stderr, flush=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if c.run_file is not None:  # kept as given; the processes read the resolved one
            shutil.copyfile(c.run_file, self.run_dir / RUN_FILE_COPY)
        try:
            self.tracker = Tracker(
                c.report_to,
                run_dir=self.run_dir,
                run_id=self.run_id,
                policies=c.policies,
                config=json.loads(c.model_dump_json()),
            )
        except Exception as exc:  # e.g. W&B online without a login: say so, start nothing
            self.state.status = f"failed: --report-to: {type(exc).__name__}: {exc}"
            log.error("%s", self.state.status)
            return self.report()
        if self.use_fork_server:
            # importing beside the model's preparation and the broker's start; the run
            # waits for it before its first process (prepare_fork_server)
            fork_server_for({**os.environ, **PROCESS_DEFAULTS})
        if c.model or (c.model_dir is not None and is_users_model(c.model_dir)):
            if c.model:  # a packaged pretrained model, converted once into the cache
                try:
                    model_dir = await asyncio.to_thread(ensure_pretrained, c.model, c.cache_dir)
                except Unrecoverable as exc:  # e.g. its package is not installed
                    self.state.status = f"failed: {exc}"
                    log.error("%s", exc)
                    return self.report()
            else:
                assert c.model_dir is not None
                model_dir = c.model_dir  # the user's model, used as it is
            problem = await asyncio.to_thread(self.check_users_model, model_dir)
            if problem:
                # before any process starts: one line, all of it, as the run's status
                self.state.status = f"failed: {problem}"
                log.error("%s", problem)
                return self.report()
        else:
            # The built-in model is warmed up on a built-in task; a data file (or any other
            # task without a teacher) gets the arithmetic one: bring a real model for it.
            # (episodes of an environment have no answers to warm up on: the arithmetic
            # model, whose byte-level tokenizer reads any text and writes numbers)
            warmup_task = (
                c.task if c.task in task_names() and c.task != "episodes" else "arithmetic"
            )
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
        if c.nats_url:
            servers: list[EmbeddedNats] = []
        elif c.nats_cluster > 1:
            servers = embedded_cluster(self.run_dir / "nats", c.nats_cluster, token=nats_token)
        else:
            servers = [EmbeddedNats(self.run_dir / "nats", token=nats_token)]
        self.nats_servers = servers
        url = c.nats_url or ",".join(server.start() for server in servers)
        for server in servers:
            assert server.process is not None
            self.pin(server.process.pid, ["slot-0"])
        if len(servers) > 1 or c.nats_url:
            # a cluster (its own, or brokers given by URL, maybe just started) elects a
            # JetStream leader first: no service starts before
            try:
                await wait_for_jetstream(url, nats_token)
            except Unrecoverable as exc:
                for server in servers:
                    server.stop()
                self.state.status = f"failed: {exc}"
                log.error("%s", exc)
                return self.report()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        try:
            gateway_port = free_port()
            env = self.service_env(self.write_spec(url, model_dir, gateway_port))
            # credentials travel in the environment only, never in the run directory
            env[variable(MESH, "nats_token")] = nats_token
            if len(servers) > 1:
                env[variable(MESH, "nats_replicas")] = str(len(servers))
            runner_key = variable(AGENTS, "gateway_key")
            if not env.get(runner_key):
                # The agent runner's own operator key, beside the user's keys (if any):
                # the user's agents open sessions with theirs, the runner with this one.
                self.gateway_key = secrets.token_urlsafe(24)
                keys = variable(GATEWAY, "api_keys")
                env[keys] = ",".join(filter(None, [env.get(keys, ""), self.gateway_key]))
                env[runner_key] = self.gateway_key
            self.connection = RunConnection(
                run_id=self.run_id,
                nats_url=url,
                nats_token=nats_token,
                gateway_url=f"http://127.0.0.1:{gateway_port}",
                gateway_key=env[runner_key],
            )
            self.connection.write(self.run_dir)
            await self.prepare_fork_server(env)
            # stderr: stdout is for results (`seamlessflow bench` prints its JSON there)
            print(self.connection.attach_instructions(self.run_dir), file=sys.stderr, flush=True)
            if c.builtin_env:
                env[variable(AGENTS, "env_url")] = await self.start_builtin_env(env)
            elif c.env:
                env[variable(AGENTS, "env_url")] = c.env
            # in the table's order; the agents last, once the mesh they use is up
            for spec in SERVICE_TABLE:
                if spec.name == "agents" or spec.optional:
                    continue
                if spec.name == "gateway" and c.gateways > 1:
                    shared = {**env, variable(GATEWAY, "reuse_port"): "true"}
                    for index in range(c.gateways):
                        self.spawn(f"gateway-{index}", "gateway", shared)
                    continue
                if not spec.per_policy:
                    self.spawn(spec.name, spec.name, env)
                    continue
                for policy in c.policies:
                    self.spawn_for_policy(policy, spec.name, env)
            if c.gateways > 1:
                # the agents' connections are kept alive: opened before every gateway
                # process listens, they would all stay on the first one
                gateways = [f"gateway-{index}" for index in range(c.gateways)]
                await self.logged(gateways, "gateway listening", GATEWAYS_READY_S)
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
            for server in servers:
                server.stop()
        return self.report()

    async def start_builtin_env(self, run_env: dict[str, str]) -> str:
        """Start the built-in environment server (``sf_envs``) on a port of its own, as a
        supervised process (restarted on the same port if it dies: episodes open on it
        fail with ``env_lost``, later ones play on the new one); its URL, once it
        listens (or the wait ends: supervision reports a server that exited)."""
        c = self.config
        port = free_port()
        self.spawn(
            "env",
            "env",
            {
                **run_env,
                variable(ENV, "name"): c.builtin_env,
                variable(ENV, "host"): "127.0.0.1",
                variable(ENV, "port"): str(port),
            },
        )
        await self.logged(["env"], "listening on", ENV_READY_S)
        return f"http://127.0.0.1:{port}"

    def check_users_model(self, model_dir: Path) -> str | None:
        """What the model lacks for this run (every service's needs, and a context for
        the task's longest prompt plus ``max_tokens``), as one line; None if usable."""
        from seamlessflow.assets.model_check import (
            TRANSFORMERS_CAUSAL_LM,
            ModelNeeds,
            ModelUnfit,
            check_model,
            task_context_tokens,
        )
        from seamlessflow.tasks.schedule import schedule_sources
        from sf_engine.backends import ENGINE_BACKENDS

        c = self.config
        context = max(
            task_context_tokens(model_dir, task, c.seed, c.max_tokens) or 0
            for task in schedule_sources(c.task)  # a schedule: its every source
        )
        # the engines' backend comes from the environment, as their processes read it
        # (an unknown name is the engine's own error: checked here as transformers)
        backend = ENGINE_BACKENDS.find(engine_backend())
        needs = ModelNeeds(
            architecture=backend.architecture if backend else TRANSFORMERS_CAUSAL_LM,
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
        layout = deployment(self.mode.layout, self.config.engines)
        # with SF_WEIGHTS_GROUP_BACKEND set, every engine joins its trainer's push group
        env = {
            **run_env,
            variable(MESH, "policy"): policy,
            variable(WEIGHTS, "group_size"): str(1 + len(layout.engines)),
            # the policies' trainers share this host's memory (micro-batch planning)
            variable(TRAINER, "trainers_on_host"): str(len(self.config.policies)),
        }

        def slot(name: str) -> str:
            return self.label(policy, name)

        if service == "engine":
            # vLLM engines on a GPU size their share of the card by this (VllmSettings)
            env[variable(VLLM, "colocated_engines")] = str(
                len(layout.engines) * len(self.config.policies)
            )
            for rank, engine in enumerate(layout.engines, start=1):
                engine_id = self.label(policy, engine.engine_id)
                self.process_policy[engine_id] = policy
                self.spawn(
                    engine_id,
                    "engine",
                    {
                        **env,
                        variable(ENGINE, "engine_id"): engine_id,
                        variable(MESH, "resource_tags"): engine.tags,
                        variable(MESH, "resource_slots"): slot(engine.slot),
                        variable(WEIGHTS, "group_rank"): str(rank),  # the trainer is 0
                    },
                    [slot(engine.slot)],
                )
            return
        label = self.label(policy, service)
        self.process_policy[label] = policy
        if service == "trainer":
            trainer_slots = [slot(s) for s in layout.trainer_slots]
            threads = variable(TRAINER, "torch_threads")
            env = {
                **env,
                variable(MESH, "resource_tags"): layout.trainer_tags,
                variable(MESH, "resource_slots"): ",".join(trainer_slots),
                # one thread per slot it trains on, unless the user's environment says
                # otherwise (more threads than its slots' cores is the user's choice)
                threads: env.get(threads) or str(len(trainer_slots)),
            }
            eval_task = self.config.eval_task_of().get(policy)
            if eval_task:
                env[variable(TRAINER, "eval_task")] = eval_task
            self.spawn(label, service, env, trainer_slots)
        else:
            self.spawn(label, service, env)

    async def _follow(self, url: str, stop: asyncio.Event) -> None:
        subjects = Subjects(self.run_id)
        try:
            follower = await connect(url, subjects, name="seamlessflow-up", token=self.nats_token)
        except Unrecoverable as exc:
            self.state.status = f"failed: {exc}"
            log.error("%s", exc)
            return
        metrics_file = (self.run_dir / "metrics.jsonl").open("a")
        progress = Progress(self.config, self.run_id, enabled=self.config.live)
        try:
            problem = await self._wait_for_stream(follower, subjects.stream_metrics(), stop)
            if problem:
                self.state.status = f"failed: {problem}"
                log.error(problem)
                return
            # an ordered consumer from the start, with a heartbeat: back within seconds of
            # a NATS restart (the replay marker is unused: every message is handled alike)
            sub, _ = await follower.follow(subjects.stream_metrics(), subjects.train_all())
            with progress:
                while not stop.is_set():
                    problem = self.unexpected_exit()
                    if problem:
                        self.state.status = f"failed: {problem}"
                        progress.tick(self.state)  # the live table shows why, as its caption
                        log.error(problem)
                        return
                    msg = await next_message(sub, timeout=0.5)
                    if msg is None:
                        progress.tick(self.state)
                        continue
                    message = decode(msg.data, TrainProgress)
                    if message.policy not in self.state.metrics_by_policy:
                        continue  # not a policy of this run's configuration
                    if isinstance(message, TrainingPlanned):
                        continue  # the trainer's budget: the run's own configuration
                    if isinstance(message, TrainEvalMetrics):
                        self.state.evals_by_policy.setdefault(message.policy, []).append(message)
                        self.tracker.evaluation(message)
                        metrics_file.write(json.dumps(struct_dict(message)) + "\n")
                        metrics_file.flush()
                        continue
                    if isinstance(message, TrainingFinished):
                        self.state.finished_by_policy[message.policy] = message
                        self.finished_policies.add(message.policy)
                        if len(self.finished_policies) == len(self.config.policies):
                            self.state.status = "finished"
                            await self._read_data_reports(follower, subjects)
                            return
                        continue
                    self.state.metrics_by_policy[message.policy].append(message)
                    self.tracker.step(message)
                    metrics_file.write(json.dumps(struct_dict(message)) + "\n")
                    metrics_file.flush()
                    progress.update(self.state, message.policy)
            self.state.status = "interrupted"
        finally:
            metrics_file.close()
            await follower.close()

    def report(self) -> Summary:
        """The run's report (``sf_app.run.report``), then its figures to the trackers,
        which are closed (a run reports once)."""
        summary = write_report(self.state)
        self.tracker.finish(asdict(summary), self.run_dir)
        self.tracker.close()
        return summary

    async def _read_data_reports(self, bus: Bus, subjects: Subjects) -> None:
        """The data algorithms' records (epochs, the first policy's batch reports) for
        the report; a run whose broker cannot answer now reports without them."""
        stream = subjects.stream_metrics()
        batch_subject = subjects.for_policy(self.config.policies[0]).data_batch_report()
        try:
            epochs = await bus.read_subject(stream, subjects.data_epoch_report())
            batches = await bus.read_subject(stream, batch_subject)
        except (BrokerUnavailable, *BROKER_ERRORS) as exc:
            log.warning("the data filters' records could not be read: %s", exc)
            return
        self.state.epochs = [decode(msg.data, EpochFilterReport) for msg in epochs]
        self.state.batch_reports = [decode(msg.data, BatchFilterReport) for msg in batches]

    async def _wait_for_stream(self, bus: Bus, name: str, stop: asyncio.Event) -> str | None:
        """Wait until a service created the run's streams; a crashed service is returned."""
        while not stop.is_set():
            if await bus.stream_exists(name):
                return None
            problem = self.unexpected_exit()
            if problem:
                return problem
            await asyncio.sleep(0.2)
        return None


def trainer_device() -> str:
    """The device the run's trainers compute on (``SF_TRAINER_DEVICE``; the CPU)."""
    return os.environ.get(variable(TRAINER, "device"), "cpu")


def engine_backend() -> str:
    """The run's engines' backend, from the environment as their processes read it."""
    return os.environ.get(variable(ENGINE, "backend"), ENGINE.model_fields["backend"].default)


def engine_device() -> str:
    """Where the run's engines compute: their backend's device (``hf``:
    ``SF_ENGINE_HF_DEVICE``; vLLM: the GPU if any)."""
    own = BACKEND_SETTINGS.get(engine_backend())
    return own().model_device() if own is not None else "cpu"


def run_embedded(config: RunConfig) -> Summary:
    import uvloop

    run = EmbeddedRun(config)
    with contextlib.suppress(KeyboardInterrupt):
        return uvloop.run(run.run())
    return run.report()


SHM_DIR = Path("/dev/shm")
SHM_COPIES = 6
"""Shared memory an embedded run asks for before it sends weights through it, in copies
of the model's weights: the trainer keeps ``SF_WEIGHTS_KEEP_CHAINS`` (2) chains of a full
payload and its deltas, and writes the next beside them."""


def local_weight_transport(
    model_dir: Path, trainer_device: str = "cpu", engine_device: str = "cpu"
) -> dict[str, str]:
    """How weights travel in an embedded run, where every process is on this host (the
    ``weights`` section's defaults; ``SF_WEIGHTS_*`` set by the user win):

    - a pull store: ``shm`` (the trainer writes a file in /dev/shm, engines map it: a
      memcpy) unless /dev/shm is missing or has room for fewer than ``SHM_COPIES``
      copies of the weights (a container's default is 64 MB), then ``object`` (the
      broker's object store: each payload crosses loopback TCP twice and JetStream's
      file store). For 538 MB (SmolLM2-135M in fp32) that is ~1.5 s of syncing per
      version against ~8 s (docs/benchmarks.md, "Weight sync");
    - with the trainer and the engines on CUDA, ``cuda_ipc`` before it (the trainer's
      device buffers mapped by the engines; the pull store is its fallback): on an H200
      the engine's side copied 3.55 GB in 0.05 s (docs/benchmarks.md, "The second H200
      lease").

    ``engine_placement`` says where the engines are, for a user who sets
    ``SF_WEIGHTS_TRANSPORT=auto``."""
    on_cuda = trainer_device.startswith("cuda") and engine_device.startswith("cuda")
    placement = "this-host-cuda" if on_cuda else "this-host"
    pull = "shm"
    weights = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        free = 0
    if free < SHM_COPIES * weights:
        log.info("weights through the object store: /dev/shm has %d MB free, fewer than "
                 "%d copies of the weights", free >> 20, SHM_COPIES)  # fmt: skip
        pull = "object"
    if on_cuda:
        return {"transport": "cuda_ipc", "ipc_fallback": pull, "engine_placement": placement}
    return {"transport": pull, "engine_placement": placement}
