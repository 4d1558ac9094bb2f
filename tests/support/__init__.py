"""Plain helpers shared by the tests (fixtures live in tests/conftest.py): where the
repository is, free ports, waiting for a condition, a mesh of services in the test's
event loop, playing the trainer on the bus, reading back recorded turns, a small
embedded run, loading a loadtest script, and a TCP proxy that loses what crosses it.

The suite is a package (``tests``): every test imports its helpers from
``tests.support`` and its modules, never from another test module. The modules here:
``bench_results`` (a bench's result file), ``checkpoint_files`` (a checkpoint's files
written by hand), ``compose_render`` (compose files read as compose reads them),
``engines`` (engines started for a test, the fp32 tolerance), ``envserver`` (an OpenEnv
server in a thread), ``openai_shapes`` (OpenAI's documented response shapes), ``ranks``
(trainer ranks started as processes, their results compared), ``request_params`` (the
request parameters refused or without effect), ``run_files`` (run files written for a
test), ``scripted_replies`` and ``tool_script`` (engines and gateways that answer from
a script), ``store`` (a run's JetStream store read back), ``tiny_models`` (small real
torch policies), ``token_texts`` (text split across tokens), ``tracking_steps`` (steps
as the trackers record them), ``trainer_batches`` and ``trainer_rank`` (the script each
rank runs), ``wandb_records``, ``weight_states`` (small weight states and their round
trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from seamlessflow.bus import Bus, connect
from seamlessflow.protocol import Subjects
from sf_app.run.supervisor import free_port

__all__ = [
    "GATEWAY_MAX_CONTEXT",
    "LOADTESTS",
    "REPO_ROOT",
    "SUPPORT_DIR",
    "TESTS_DIR",
    "InProcessMesh",
    "TcpProxy",
    "announce_plan",
    "announce_weights",
    "eventually",
    "free_port",
    "free_ports",
    "load_loadtest",
    "main_job_model",
    "publish_perturbed_version",
    "recorded_turns",
    "rollout_gateway",
    "session_auth",
    "session_turns",
    "small_embedded_run",
    "start_rollout",
    "trajectory_events",
]


def main_job_model() -> str:
    """The pretrained model the main job trains (the justfile's ``up`` recipe's
    ``--model``), which compose trains by default too."""
    justfile = (REPO_ROOT / "justfile").read_text()
    recipe = justfile.split("\nup *ARGS:", 1)[1].split("\n\n")[0]
    return recipe.split("--model", 1)[1].split()[0]


SUPPORT_DIR = Path(__file__).resolve().parent
"""tests/support/: the helper modules and the scripts tests run as processes
(trainer_rank.py)."""
TESTS_DIR = SUPPORT_DIR.parent
REPO_ROOT = TESTS_DIR.parent
"""The repository's root: what tests read (loadtests/, examples/, compose/, docs/)."""
LOADTESTS = REPO_ROOT / "loadtests"

T = TypeVar("T")


def free_ports(count: int) -> list[int]:
    """``count`` ports nothing listened on a moment ago; all bound at once, so they differ
    (``free_port`` twice may give the same port)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


async def eventually(
    condition: Callable[[], T | Awaitable[T]],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
) -> T:
    """Poll ``condition`` (a function or a coroutine function) until it returns something
    truthy, and return that; fail naming ``what`` when ``timeout_s`` passes first. For a
    test that waits for something to happen elsewhere (another task, process or service)
    instead of sleeping a fixed time and hoping it did."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(interval_s)


class InProcessMesh:
    """Services of one run started in this test's event loop, each with its own
    connection, exactly as ``run_service`` would start them (minus signals)."""

    def __init__(
        self, nats_url: str, run_id: str, model_dir: Path | None, policies: str = ""
    ) -> None:
        from seamlessflow.settings import MeshSettings

        self.mesh = MeshSettings(
            nats_url=nats_url, run_id=run_id, model_dir=model_dir, policies=policies
        )
        self.running: list[tuple[Any, Any, asyncio.Task[None]]] = []
        """(service, its ServiceContext, the task running it), in the order started."""

    async def start(self, service, policy: str = ""):  # type: ignore[no-untyped-def]
        """Start ``service``; ``policy``: the one it serves or trains (``SF_POLICY``)."""
        import asyncio

        from seamlessflow.service import ServiceContext

        mesh = self.mesh.model_copy(update={"policy": policy}) if policy else self.mesh
        service_bus = await connect(
            mesh.nats_url, Subjects(mesh.run_id, mesh.policy), name=service.name
        )
        await service_bus.ensure_streams(mesh.policy_names())
        ctx = ServiceContext(mesh=mesh, bus=service_bus)
        task = asyncio.create_task(service.run(ctx))
        self.running.append((service, ctx, task))
        return service

    async def stop(self) -> None:
        running, self.running = self.running, []
        for _, ctx, _ in reversed(running):
            ctx.stopping.set()
        # every service is stopped and its connection drained, even after one failed;
        # then the first failure is raised
        failures: list[BaseException] = []
        for service, ctx, task in reversed(running):
            try:
                done, _ = await asyncio.wait([task], timeout=STOP_BUDGET_S)
                if not done:
                    # where every task of the loop waits, before cancelling changes it:
                    # a service that does not stop is a bug to find, not a slow machine
                    where = tasks_waiting()
                    task.cancel()
                    await asyncio.wait([task], timeout=STOP_BUDGET_S)
                    raise AssertionError(
                        f"{service.name} did not stop within {STOP_BUDGET_S} s of being "
                        f"asked; the loop's tasks were waiting at:\n{where}"
                    )
                task.result()
            except BaseException as exc:
                failures.append(exc)
            finally:
                await ctx.bus.drain()
        if failures:
            raise failures[0]


STOP_BUDGET_S = 60.0
"""How long ``InProcessMesh.stop`` waits for one service to return once asked: a healthy
one returns within a second or two; on a loaded two-core machine a weight copy or a decode
step in flight (which a cancelled engine finishes before releasing its lock) can take
several seconds more."""


def tasks_waiting() -> str:
    """One line per pending task of the running loop: its name and the innermost frame it
    is suspended in, the first thing to read when something does not stop."""
    lines = []
    for task in asyncio.all_tasks():
        frames = task.get_stack()
        frame = frames[-1] if frames else None
        at = (
            f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
            if frame is not None
            else "(not started)"
        )
        lines.append(f"  {task.get_name()} ({task.get_coro()!r:.80}): {at}")
    return "\n".join(sorted(lines))


class TcpProxy:
    """A real TCP proxy in front of a server (a NATS server here): forwards bytes both
    ways, and on demand loses what its clients send (as into the socket of a server
    that died: the writes succeed, nothing arrives) and cuts every connection (the
    clients see the server go away and reconnect through the proxy)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.losing = False
        """While set, what clients send is read and dropped."""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._pipes: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listen on a free loopback port; return it."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection(*self.target)
        self._writers |= {client_w, server_w}
        for pipe in (self._pipe(client_r, server_w, upstream=True), self._pipe(server_r, client_w)):
            task = asyncio.create_task(pipe)
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool = False
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if upstream and self.losing:
                    continue
                writer.write(data)
                await writer.drain()
        writer.close()

    def cut(self) -> None:
        """Close every connection now (both sides) and stop losing: the next ones pass."""
        self.losing = False
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def close(self) -> None:
        self.cut()
        for task in list(self._pipes):
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


GATEWAY_MAX_CONTEXT = 128
"""The context of the gateway of ``start_rollout`` (the ``gateway_url`` fixture)."""


async def start_rollout(  # type: ignore[no-untyped-def]
    mesh: InProcessMesh, engine, max_context: int = GATEWAY_MAX_CONTEXT
) -> str:
    """Start what serves an agent on ``mesh``: the scheduler, weight-sync, one engine
    worker of settings ``engine`` (``EngineSettings``) and a gateway; return the gateway's
    URL once both are ready."""
    from sf_engine.service import EngineService
    from sf_gateway.service import GatewayService
    from sf_gateway.settings import GatewaySettings
    from sf_tag_scheduler.service import TagSchedulerService
    from sf_weight_sync.service import WeightSyncService

    await mesh.start(TagSchedulerService())
    await mesh.start(WeightSyncService())
    engine_worker = await mesh.start(EngineService(engine))
    gateway = await mesh.start(GatewayService(GatewaySettings(port=0, max_context=max_context)))
    await asyncio.wait_for(gateway.ready.wait(), 30)
    # and serving: vLLM on two busy cores takes longer to start than the gateway waits
    # for an engine (``engine_wait_s``), and a test's first call would get a 503
    await asyncio.wait_for(engine_worker.ready.wait(), 600)
    return f"http://127.0.0.1:{gateway.bound_port}"


@contextlib.asynccontextmanager
async def rollout_gateway(  # type: ignore[no-untyped-def]
    nats_url: str, run_id: str, model_dir: Path, engine, max_context: int
) -> AsyncIterator[str]:
    """``start_rollout`` on a mesh of its own serving ``model_dir``; yields the gateway's
    URL and stops the mesh after."""
    mesh = InProcessMesh(nats_url, run_id, model_dir)
    try:
        yield await start_rollout(mesh, engine, max_context)
    finally:
        await mesh.stop()


async def announce_plan(bus: Bus, steps: int, seed: int = 0) -> None:
    """Announce a step budget as ``sf_trainer`` does at start (TrainingPlanned): what the
    trajectory service dispatches for."""
    from seamlessflow.protocol import MessageIds, TrainingPlanned

    policy = bus.subjects.policy
    await bus.js_publish(
        bus.subjects.train_plan(),
        TrainingPlanned(steps=steps, seed=seed, policy=policy),
        msg_id=MessageIds.train_plan(policy, f"test-{steps}-{seed}"),
    )


async def announce_weights(bus: Bus, manifest, completed: bool = False) -> None:  # type: ignore[no-untyped-def]
    """Announce a stored payload as ``sf_trainer`` does after a step; ``completed``: a
    ``cuda_ipc`` version's second announcement, its fallback stored."""
    from seamlessflow.protocol import MessageIds, WeightsPublished

    policy, version = bus.subjects.policy, manifest.version
    await bus.js_publish(
        bus.subjects.weights_published(),
        WeightsPublished(manifest=manifest, step=version),
        msg_id=MessageIds.weights_stored(policy, version)
        if completed
        else MessageIds.weights(policy, version),
    )


async def publish_perturbed_version(bus: Bus, version: int, base: dict) -> None:  # type: ignore[type-arg]
    """Play the trainer: store a slightly perturbed copy of ``base`` as a full payload of
    ``version`` in the object store, then announce it."""
    import torch

    from seamlessflow.weights import ObjectStorePayloads, WeightEncoder, WeightPublisher

    state = {k: v + 0.01 * torch.randn_like(v) for k, v in base.items()}
    publisher = WeightPublisher(ObjectStorePayloads(bus), WeightEncoder(bucket_bytes=1 << 20))
    await announce_weights(bus, await publisher.publish(version, state))


async def trajectory_events(bus: Bus) -> list:  # type: ignore[type-arg]
    """Every event of the run's durable trajectory stream, in order."""
    from seamlessflow.protocol import TrajectoryEvent, decode

    s = bus.subjects
    stored = await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    return [decode(m.data, TrajectoryEvent) for m in stored]


async def recorded_turns(bus: Bus) -> list:  # type: ignore[type-arg]
    """Every TurnRecorded in the run's durable trajectory stream, in order."""
    from seamlessflow.protocol import TurnRecorded

    return [e for e in await trajectory_events(bus) if isinstance(e, TurnRecorded)]


async def session_turns(bus: Bus, session_id: str) -> list:  # type: ignore[type-arg]
    """The TurnRecorded of one session, in order, from its subject of the durable
    trajectory stream."""
    from seamlessflow.protocol import TrajectoryEvent, TurnRecorded, decode

    s = bus.subjects
    stored = await bus.read_subject(s.stream_trajectory(), s.trajectory_event(session_id))
    events = (decode(m.data, TrajectoryEvent) for m in stored)
    return [e for e in events if isinstance(e, TurnRecorded)]


def session_auth(session: dict) -> dict[str, str]:  # type: ignore[type-arg]
    """Headers carrying a session's own key (what its OpenAI client sends)."""
    return {"authorization": f"Bearer {session['api_key']}"}


def small_embedded_run(  # type: ignore[no-untyped-def]
    run_id: str, runs_dir: Path, model_dir: Path, steps: int, **config: object
):
    """An embedded run (``seamlessflow up``) of a few small steps on the test model;
    ``config``: further ``RunConfig`` fields (over the small group, batch and agents)."""
    from sf_app.run.config import RunConfig
    from sf_app.run.embedded import EmbeddedRun

    # float32 as the suite's other trainers (tests/conftest.py), unless a test asks
    small = {"group_size": 4, "groups_per_batch": 2, "agent_concurrency": 8, "precision": "fp32"}
    return EmbeddedRun(
        RunConfig(
            run_id=run_id,
            runs_dir=runs_dir,
            model_dir=model_dir,
            steps=steps,
            engine_batch_size=8,
            live=False,
            **{**small, **config},  # type: ignore[arg-type]
        )
    )


def load_loadtest(name: str):  # type: ignore[no-untyped-def]
    """``loadtests/<name>.py`` as a module (the loadtests are scripts, not a package),
    registered under ``loadtests_<name>``: dataclasses look their module up by name.

    A script imports the other scripts it uses by their bare names (``import
    peer_judge``), as it runs from ``loadtests/``. Those are loaded first, from their
    files, under those names, so its imports find them without loadtests/ on
    ``sys.path``."""
    return _load_script(name, f"loadtests_{name}")


def _load_script(name: str, module_name: str):  # type: ignore[no-untyped-def]
    import importlib.util
    import sys

    path = LOADTESTS / f"{name}.py"
    for sibling in _scripts_imported_by(path):
        if sibling not in sys.modules:
            _load_script(sibling, sibling)
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _scripts_imported_by(path: Path) -> list[str]:
    """The other loadtests/ scripts that ``path`` imports (absolute imports whose first
    name is a script there), in the order it imports them."""
    import ast

    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name.split(".")[0] for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module.split(".")[0])
    scripts = [n for n in dict.fromkeys(names) if n != path.stem]
    return [n for n in scripts if (LOADTESTS / f"{n}.py").is_file()]


OUTSIDE_DATA_FILTER = '''"""A user's data filter, in a module outside the repo."""

from pydantic import Field

from seamlessflow.plugin_settings import PluginSettings
from sf_trajectory.data_filters import drop, keep


class LowRewardSettings(PluginSettings):
    min_mean_reward: float = Field(default=0.5, ge=0.0)


class DropLowRewardGroups:
    """Drop a group whose mean reward is below ``min_mean_reward``."""

    name = "low_reward"
    settings_class = LowRewardSettings

    def __init__(self, min_mean_reward: float) -> None:
        self.min_mean_reward = min_mean_reward

    def judge(self, group, batch_index):
        mean = sum(s.reward for s in group.samples) / len(group.samples)
        return keep(group) if mean >= self.min_mean_reward else drop(group, "low_reward")


class NotAFilter:
    name = "not_a_filter"
'''


def write_outside_filter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``OUTSIDE_DATA_FILTER`` as ``my_filters.py`` in ``tmp_path``, importable for the
    test: the dotted path of its filter."""
    (tmp_path / "my_filters.py").write_text(OUTSIDE_DATA_FILTER)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_filters:DropLowRewardGroups"
