"""Faults: a real run survives SIGKILL of every service in turn and a NATS crash.

First the pieces, each against real processes (docs/design.md, "Faults"): supervision
and its budget, the NATS server restarted in place under a follower, a publisher and a
consumer, a tag-scheduler that restarts knowing its resources. Then the proof (slow):
one embedded run (every service its own process, the embedded nats-server) is killed
piece by piece, each kill after the run made a step since the previous one; another
kills the agent runner, then two services at once, twice. The run's
supervision starts each process again (the trainer from its latest checkpoint, the
NATS server in place), and the run must finish its steps. Then the durable streams,
read from the run's JetStream store, must account for every trajectory:

- no session is in two batches, and the trainer trained each batch once, in order;
- every session is in a batch (then it finished), or named as dropped in exactly one
  batch report, with its reason, or *pending*: its group was still forming when the
  trainer finished (not in a batch, not closed, not dropped). Groups are handed out
  only for the batches the run needs, so pending groups are at most the last batches'
  worth.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from seamlessflow.batches import stored_batches
from seamlessflow.bus import JETSTREAM_UNAVAILABLE, Bus, ack_redeliverable, connect
from seamlessflow.natsserver import EmbeddedNats, embedded_cluster
from seamlessflow.protocol import (
    GroupClosed,
    PhaseChanged,
    ResourceRegister,
    RoleAssignment,
    SessionFinished,
    SessionOpened,
    Subjects,
    TrainStepMetrics,
    decode,
)
from sf_app.run import supervisor
from sf_app.run.config import RunConfig
from sf_app.run.embedded import EmbeddedRun
from sf_app.run.report import Summary
from sf_tag_scheduler.service import TagSchedulerService
from sf_tag_scheduler.settings import TagSchedulerSettings
from tests.support import InProcessMesh, eventually
from tests.support.store import cancel_if_running, run_store, stored_events_and_reports

# other processes (services, servers, ranks or tools started as commands): see conftest
pytestmark = pytest.mark.integration

# The scheduler first: the engine killed next must be declared dead by a scheduler
# that restored its pool (the gateway re-routes on that). The trajectory service after
# the gateway: it replays the groups the gateway's restart made it close.
KILLS = ["tag-scheduler", "engine-0", "gateway", "trajectory", "trainer", "weight-sync", "nats"]
STEPS = 2 * len(KILLS) + 2  # a kill may land between two steps made at once
GROUP_SIZE, GROUPS_PER_BATCH = 4, 2
# Two at once, and the agent runner (its sessions in flight are never finished: their
# groups time out). The gateway with the trainer: a gateway that comes back continues
# its open sessions while the trainer resumes.
KILLS_AT_ONCE = [("agents",), ("engine-0", "trajectory"), ("gateway", "trainer")]
STEPS_AT_ONCE = 2 * len(KILLS_AT_ONCE) + 2


async def test_supervision_restarts_within_the_budget_then_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = EmbeddedRun(RunConfig(run_id="sup", runs_dir=tmp_path, max_restarts=1, live=False))
    env = dict(os.environ)
    # A trainer that exits 0 has finished: its TrainingFinished gets FINISH_GRACE_S to
    # arrive. That grace runs on the clock while the broken process starts twice: on a
    # loaded machine the two starts took longer than a grace of seconds, and the trainer
    # was restarted before the broken process failed. So its grace cannot run out until
    # the test ends it (below).
    monkeypatch.setattr(supervisor, "FINISH_GRACE_S", 3600.0)
    try:
        run.spawn("broken", "no-such-service", env)  # exits 2 at once
        run.spawn("trainer", "--help", env)  # exits 0 at once
        problem = await eventually(run.unexpected_exit, 60, "the broken process's failure")
        assert problem.startswith("broken exited with code 2 after 1 restarts"), problem
        del run.processes["broken"]  # (the run would end here)
        trainer = run.processes["trainer"]
        await eventually(lambda: trainer.poll() is not None, 60, "the trainer's exit")
        assert run.unexpected_exit() is None
        assert run.restarts == {"broken": 1}  # the trainer is within its grace
        monkeypatch.setattr(supervisor, "FINISH_GRACE_S", 0.0)  # over, and no finish came
        assert run.unexpected_exit() is None
        assert run.restarts == {"broken": 1, "trainer": 1}
    finally:
        run.stop_processes()
    assert (tmp_path / "sup" / "logs" / "broken.log").read_text().count("no-such-service") == 2


async def test_a_crashed_nats_server_restarts_in_place_and_its_clients_carry_on(
    tmp_path: Path,
) -> None:
    """Same URL, same store; a follower hears new messages within seconds, a publish
    the dying connection swallowed is retried and lands once, and an ack the broker
    cannot confirm is not an error (the message is redelivered; consumers skip it)."""
    subjects = Subjects("crash")
    with EmbeddedNats(tmp_path / "nats") as server:
        bus = await connect(server.url, subjects, name="client")
        try:
            await bus.ensure_streams()
            follower, _ = await bus.follow(
                subjects.stream_trajectory(), subjects.trajectory_events_all()
            )
            await bus.js_publish(subjects.trajectory_event("a"), SessionFinished(session_id="a"))
            await follower.next_msg(timeout=5)
            pull = await bus.js.pull_subscribe(
                subjects.trajectory_events_all(), "t", stream=subjects.stream_trajectory()
            )
            [unacked] = await pull.fetch(1, timeout=5)
            url = server.url
            assert server.process is not None
            server.process.kill()
            server.process.wait()
            await ack_redeliverable(unacked)
            assert server.restart() == url
            await bus.js_publish(
                subjects.trajectory_event("b"), SessionFinished(session_id="b"), msg_id="b"
            )
            # the follower's wait is bounded: no reconnect within it is a TimeoutError
            event = decode((await follower.next_msg(timeout=10)).data, SessionFinished)
            assert event.session_id == "b"
            stored = await bus.read_all(
                subjects.stream_trajectory(), subjects.trajectory_events_all()
            )
            assert [decode(m.data, SessionFinished).session_id for m in stored] == ["a", "b"]
        finally:
            await bus.drain()


async def test_a_restarted_tag_scheduler_knows_its_resources_and_their_new_processes(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    """Resources register once: a restarted scheduler reads them back from its KV bucket
    (so it still declares a silent one dead), and a process that registers under the id
    of a live one replaces it: the old one is declared dead at once (the gateway then
    re-routes what it held)."""
    settings = TagSchedulerSettings(dead_after_s=1.5, check_interval_s=0.1)
    phases = await bus.nc.subscribe(bus.subjects.sched_phase())

    async def register(resource_id: str, pid: int) -> None:
        request = ResourceRegister(
            resource_id=resource_id, kind="engine", tags=["rollout"], host="h", pid=pid
        )
        await bus.request(bus.subjects.sched_register(), request, RoleAssignment)

    async def declared_dead(timeout: float) -> str:
        async with asyncio.timeout(timeout):
            while True:
                change = decode((await phases.next_msg(timeout=timeout)).data, PhaseChanged)
                if change.phase == "dead":
                    return change.resource_id

    first = InProcessMesh(nats_url, run_id, None)
    await asyncio.wait_for((await first.start(TagSchedulerService(settings))).ready.wait(), 10)
    await register("engine-a", pid=1)  # then silent
    await first.stop()
    again = InProcessMesh(nats_url, run_id, None)
    scheduler = await again.start(TagSchedulerService(settings))
    try:
        await asyncio.wait_for(scheduler.ready.wait(), 10)
        assert "engine-a" in scheduler.resources
        assert await declared_dead(10) == "engine-a"
        await register("engine-b", pid=1)
        await register("engine-b", pid=2)  # restarted faster than dead_after_s
        assert await declared_dead(1.0) == "engine-b"
        assert scheduler.resources["engine-b"].alive
    finally:
        await again.stop()
        await phases.unsubscribe()


async def test_a_resource_that_leaves_is_retired_at_once_without_a_warning(
    nats_url: str, run_id: str, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    """A process that stops cleanly (the trainer at the end of its run) sends a last
    heartbeat saying so: retired at once with a "left" line, not declared dead
    ``dead_after_s`` later with a warning."""
    from seamlessflow.protocol import Heartbeat

    settings = TagSchedulerSettings(dead_after_s=30.0, check_interval_s=0.1)
    phases = await bus.nc.subscribe(bus.subjects.sched_phase())
    mesh = InProcessMesh(nats_url, run_id, None)
    scheduler = await mesh.start(TagSchedulerService(settings))
    try:
        await asyncio.wait_for(scheduler.ready.wait(), 10)
        request = ResourceRegister(
            resource_id="trainer-x", kind="trainer", tags=["train"], host="h", pid=1
        )
        await bus.request(bus.subjects.sched_register(), request, RoleAssignment)
        beat = Heartbeat(resource_id="trainer-x", phase="idle", leaving=True)
        with caplog.at_level(logging.INFO, logger="sf_tag_scheduler"):
            await bus.publish(bus.subjects.sched_heartbeat("trainer-x"), beat)
            async with asyncio.timeout(5):  # far less than dead_after_s
                while True:
                    change = decode((await phases.next_msg(timeout=5)).data, PhaseChanged)
                    if change.resource_id == "trainer-x" and change.phase == "dead":
                        break
        assert not scheduler.resources["trainer-x"].alive
        messages = [r.getMessage() for r in caplog.records]
        assert "resource trainer-x left" in messages
        assert not any("missed heartbeats" in m for m in messages)
    finally:
        await mesh.stop()
        await phases.unsubscribe()


def pid_of(run: EmbeddedRun, label: str) -> int:
    if label == "nats":
        assert run.nats_server is not None and run.nats_server.process is not None
        return run.nats_server.process.pid
    return run.processes[label].pid


async def sessions_open(run: EmbeddedRun, running: asyncio.Task) -> None:  # type: ignore[type-arg]
    """Until the run's gateway holds open sessions."""
    await eventually(lambda: getattr(run, "connection", None), 90, "the run's connection details")
    async with httpx.AsyncClient(base_url=run.connection.gateway_url, timeout=5) as http:
        deadline = time.monotonic() + 90
        while not running.done():
            with contextlib.suppress(httpx.TransportError):
                if (await http.get("/healthz")).json()["sessions"] > 0:
                    return
            if time.monotonic() > deadline:
                raise AssertionError("no session open within 90s")
            await asyncio.sleep(0.05)


async def kill_in_turn(
    run: EmbeddedRun,
    running: asyncio.Task,  # type: ignore[type-arg]
    kills: list[tuple[str, ...]],
) -> None:
    """SIGKILL each group of ``kills`` (its processes at once); the next only once the
    run made a step after the kill. The agent runner and the gateway are killed while
    sessions are open (in the middle of samples)."""
    steps = 0
    for labels in kills:
        await eventually(lambda: len(run.state.metrics) > steps or running.done(), 300, "progress")  # noqa: B023
        assert not running.done(), f"the run ended before {labels} were killed: {run.state.status}"
        if {"agents", "gateway"} & set(labels):
            await sessions_open(run, running)
        steps = len(run.state.metrics)
        for label in labels:
            os.kill(pid_of(run, label), signal.SIGKILL)
        for label in labels:
            restarted = lambda: label in run.restarts or running.done()  # noqa: B023, E731
            await eventually(restarted, 30, f"{label} restart")


@pytest.fixture(autouse=True)
def stall_detection_for_a_loaded_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runs here time lost groups out after 15 s (``faults_config``), so the
    trajectory service's stall rule (no session finished for ``stall_timeouts`` group
    time-outs) would call a run stalled after 30 s. A killed engine and gateway coming
    back beside another test's mesh (the suite's parallel workers) took 46 s to finish
    a session: the run failed as stalled while it was recovering. These tests catch a
    real stall themselves (no progress for 300 s); the rule gets 8 time-outs (120 s)."""
    monkeypatch.setenv("SF_TRAJECTORY_STALL_TIMEOUTS", "8")


def faults_config(run_id: str, base_model_dir: Path, tmp_path: Path, steps: int) -> RunConfig:
    return RunConfig(
        run_id=run_id,
        runs_dir=tmp_path,
        model_dir=base_model_dir,
        steps=steps,
        group_size=GROUP_SIZE,
        groups_per_batch=GROUPS_PER_BATCH,
        engines=1,
        agent_concurrency=8,
        engine_batch_size=8,
        live=False,
        checkpoint_every=1,
        group_timeout_s=15,
        max_restarts=3,
    )


async def run_killing(config: RunConfig, kills: list[tuple[str, ...]]) -> Summary:
    """The run of ``config``, with each group of ``kills`` SIGKILLed in turn; it must
    finish its steps, each killed process restarted once and nothing else."""
    run = EmbeddedRun(config)
    running = asyncio.create_task(run.run())
    try:
        async with asyncio.timeout(900):  # against a hang (a hogged run takes ~2x)
            await kill_in_turn(run, running, kills)
            summary = await running
    finally:
        await cancel_if_running(running)

    assert summary.status == "finished", summary.status
    assert summary.final_version == config.steps
    # each killed process came back once, and nothing else had to
    killed = [label for labels in kills for label in labels]
    assert summary.restarts == dict.fromkeys(killed, 1), summary.restarts
    return summary


@contextlib.contextmanager
def cpu_hogs(count: int) -> Iterator[None]:
    """``count`` busy loops in processes of their own while the block runs: a machine
    whose cores something else wants too (CI found a session unaccounted for beside
    container builds, at a load of 5-9 on two cores)."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


CORES_LOADED_BY_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= len(
    os.sched_getaffinity(0)
)
"""The suite runs in as many pytest-xdist workers as there are cores (``just test`` on up
to four): each core is busy with the other workers' tests already."""


@pytest.mark.slow
@pytest.mark.parametrize("load", ["quiet", "hogged"])
async def test_every_service_killed_in_turn_the_run_finishes_and_accounts_for_everything(
    run_id: str, base_model_dir: Path, tmp_path: Path, load: str
) -> None:
    """``hogged``: the same beside a busy loop on every core this process may use. Not
    where the suite's own workers load every core (``just test`` on up to four cores):
    there the ``quiet`` variant already shares its cores, and `just test-portability`
    runs the whole suite beside a hog."""
    if load == "hogged" and CORES_LOADED_BY_WORKERS:
        pytest.skip("every core is loaded by the suite's other workers already")
    config = faults_config(run_id, base_model_dir, tmp_path, STEPS)
    hogs = len(os.sched_getaffinity(0)) if load == "hogged" else 0
    with cpu_hogs(hogs):
        summary = await run_killing(config, [(label,) for label in KILLS])
    await account_for_everything(config, tmp_path, summary)


@pytest.mark.slow
async def test_two_faults_at_once_and_the_agent_runner_killed_lose_nothing(
    run_id: str, base_model_dir: Path, tmp_path: Path
) -> None:
    config = faults_config(run_id, base_model_dir, tmp_path, STEPS_AT_ONCE)
    summary = await run_killing(config, KILLS_AT_ONCE)
    await account_for_everything(config, tmp_path, summary)


STALLED_AFTER_S = 300.0
"""How long a run may make no progress (``run_progress``) before a test calls it stalled.
The run as a whole has no deadline: a loaded machine that makes it take many times as
long (three servers, the services and their restarts on two cores beside whatever else
runs) passes, as long as it gets on."""


def run_progress(run: EmbeddedRun) -> tuple[int, int, int]:
    """What changes while ``run`` gets on: how many of its processes have started (written
    to their logs; imports and start-up are what a loaded machine slows most), its
    restarts and its steps. Each only grows, and has a bound, so a run that stalls stops
    changing them however much it goes on logging."""
    logs = run.run_dir / "logs"
    started = sum(1 for path in logs.glob("*.log") if path.stat().st_size)
    return started, sum(run.restarts.values()), len(run.state.metrics)


async def while_progressing(
    run: EmbeddedRun,
    running: asyncio.Task,  # type: ignore[type-arg]
    condition: Callable[[], bool],
    what: str,
) -> None:
    """Until ``condition`` holds or the run ends; fails, naming ``what``, only when the
    run made no progress for ``STALLED_AFTER_S``."""
    progress, since = run_progress(run), time.monotonic()
    while not (condition() or running.done()):
        if (now := run_progress(run)) != progress:
            progress, since = now, time.monotonic()
        elif time.monotonic() - since > STALLED_AFTER_S:
            raise AssertionError(
                f"{what}: the run made no progress for {STALLED_AFTER_S:.0f} s "
                f"(processes started, restarts, steps: {progress})"
            )
        await asyncio.sleep(0.05)


async def stream_leader(run: EmbeddedRun, stream: str) -> str:
    """The server name of ``stream``'s leader in the run's cluster."""
    assert run.connection is not None
    bus = await connect(run.connection.nats_url, Subjects(run.run_id), name="faults-probe",
                        token=run.nats_token)  # fmt: skip
    try:
        info = await bus.js.stream_info(stream)
        assert info.cluster is not None and info.cluster.leader
        return info.cluster.leader
    finally:
        await bus.drain()


@pytest.mark.slow
@pytest.mark.parametrize("store", ["kept", "deleted"])
async def test_a_cluster_loses_the_stream_leader_mid_run_and_accounts_for_everything(
    run_id: str, base_model_dir: Path, tmp_path: Path, store: str
) -> None:
    """``--nats-cluster 3``: every stream at three replicas; SIGKILL the node leading
    the trajectory stream after the first step. The other two keep a quorum, the
    services move to them, the node restarts and rejoins; the run trains every batch
    once, in order, and every session is accounted for (the module's docstring), read
    back from the three nodes' stores. ``deleted``: the node's JetStream store is gone
    when it restarts (a replaced disk): it catches up from the other two, and every
    stream ends with all three replicas current."""
    config = faults_config(run_id, base_model_dir, tmp_path, STEPS)
    config = config.model_copy(update={"nats_cluster": 3})
    run = EmbeddedRun(config)
    running = asyncio.create_task(run.run())
    try:
        # against a stall, not a deadline (the run overran fixed ones on a loaded machine)
        await while_progressing(run, running, lambda: len(run.state.metrics) >= 1, "a step")
        assert not running.done(), run.state.status
        leader = await stream_leader(run, Subjects(run_id).stream_trajectory())
        index = int(leader.removeprefix("n"))
        node = run.nats_servers[index]
        assert node.process is not None
        if store == "deleted":
            restart_in_place = node.restart

            def restart_without_store(timeout: float = 10.0) -> str:
                node.stop(timeout)
                shutil.rmtree(node.store_dir / "jetstream")
                return restart_in_place(timeout)

            node.restart = restart_without_store
        os.kill(node.process.pid, signal.SIGKILL)
        label = f"nats-{index}"
        await while_progressing(run, running, lambda: label in run.restarts, "its restart")
        await while_progressing(run, running, running.done, "the run's end")
        summary = await running
    finally:
        await cancel_if_running(running)
    assert summary.status == "finished", summary.status
    assert summary.final_version == STEPS
    assert summary.restarts == {label: 1}, summary.restarts
    steps = [
        json.loads(line)
        for line in (tmp_path / run_id / "metrics.jsonl").read_text().splitlines()
        if '"train.metrics"' in line
    ]
    assert [s["batch_index"] for s in steps] == list(range(STEPS))  # each once, in order
    assert [s["version"] for s in steps] == list(range(1, STEPS + 1))
    caught_up = await account_for_everything(config, tmp_path, summary, cluster=3)
    # the killed node holds a current replica of every stream (with its store deleted,
    # what it holds came from the other two)
    assert caught_up, "no stream reported its replicas"
    for stream, replicas in caught_up.items():
        assert len(replicas) == 3 and replicas.get(leader) is True, (
            f"{stream}: {leader} is not a current replica: {replicas}"
        )


@pytest.mark.slow
async def test_an_external_cluster_loses_a_node_for_good_and_the_run_finishes(
    run_id: str, base_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--nats-url a,b,c`` with ``SF_NATS_REPLICAS=3``: a cluster the run did not start
    (so nothing restarts its nodes). The node leading the trajectory stream is SIGKILLed
    after the first step and stays down; the other two keep the quorum, and the run
    finishes every step and accounts for every session, read from the two left."""
    monkeypatch.setenv("SF_NATS_REPLICAS", "3")
    nodes = embedded_cluster(tmp_path / "brokers", 3)
    try:
        url = ",".join(node.start() for node in nodes)
        config = faults_config(run_id, base_model_dir, tmp_path, STEPS)
        config = config.model_copy(update={"nats_url": url})
        run = EmbeddedRun(config)
        running = asyncio.create_task(run.run())
        try:
            async with asyncio.timeout(900):  # against a hang
                await eventually(
                    lambda: len(run.state.metrics) >= 1 or running.done(),
                    600,
                    "a step",
                )
                assert not running.done(), run.state.status
                leader = await stream_leader(run, Subjects(run_id).stream_trajectory())
                node = nodes[int(leader.removeprefix("n"))]
                assert node.process is not None
                node.process.kill()
                node.process.wait()
                summary = await running
        finally:
            await cancel_if_running(running)
        assert summary.status == "finished", summary.status
        assert summary.final_version == STEPS
        assert summary.restarts == {}, summary.restarts  # no service fell over
        live = ",".join(n.url for n in nodes if n.process is not None and n.process.poll() is None)
        await account_for_everything(config, tmp_path, summary, url=live)
    finally:
        for node in nodes:
            node.stop()


async def current_replicas(bus: Bus, streams: list[str]) -> dict[str, dict[str, bool]]:
    """Per stream, each server holding it and whether its copy is current (the leader's
    is), once every replica is current or after 120 s (as they were then)."""
    deadline = time.monotonic() + 120
    while True:
        seen: dict[str, dict[str, bool]] = {}
        for stream in streams:
            try:
                info = await bus.js.stream_info(stream)
            except JETSTREAM_UNAVAILABLE:  # its replicas, just started, elect a leader first
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)
                break
            assert info.cluster is not None
            replicas = {r.name: bool(r.current) and not r.lag for r in info.cluster.replicas or []}
            seen[stream] = {str(info.cluster.leader): True, **replicas}
        if len(seen) == len(streams) and all(all(r.values()) for r in seen.values()):
            return seen
        if time.monotonic() > deadline:
            return seen
        await asyncio.sleep(1.0)


async def account_for_everything(
    config: RunConfig, tmp_path: Path, summary: Summary, cluster: int = 1, url: str = ""
) -> dict[str, dict[str, bool]]:
    """The durable record, from the run's own JetStream store (``cluster`` nodes' stores),
    or from the brokers at ``url`` when the run used brokers it did not start, accounts
    for every trajectory (the module's docstring). With a cluster of its own: each
    stream's replicas and whether they are current."""
    run_id, steps_made = config.run_id, config.steps
    subjects = Subjects(run_id)
    replicas: dict[str, dict[str, bool]] = {}
    async with (
        contextlib.nullcontext(url) if url else run_store(tmp_path / run_id / "nats", cluster)
    ) as broker:
        bus = await connect(broker, subjects, name="faults-test")
        try:
            if cluster > 1 and not url:
                await bus.wait_for_jetstream(120)
                replicas = await current_replicas(bus, list(subjects.streams()))
            events, reports = await stored_events_and_reports(bus)
            batches = await stored_batches(bus)
            steps = [
                decode(m.data, TrainStepMetrics)
                for m in await bus.read_subject(subjects.stream_metrics(), subjects.train_metrics())
            ]
        finally:
            await bus.drain()

    # the trainer trained every batch once, in order
    assert [s.batch_index for s in steps] == list(range(steps_made))
    assert [s.version for s in steps] == list(range(1, steps_made + 1))
    assert sorted(b.batch_index for b in batches) == list(range(steps_made))
    batched = [s.session_id for b in batches for g in b.groups for s in g.samples]
    assert len(batched) == len(set(batched)), "a session is in two batches"
    batched_groups = {g.group_id for b in batches for g in b.groups}

    # every drop is reported once, with its reason, and never for a trained sample
    dropped: dict[str, str] = {}
    for report in reports:
        for reason, ids in report.dropped_samples.items():
            assert report.samples_dropped[reason] == len(ids)
            for sample in ids:
                assert sample not in dropped, f"{sample} reported dropped twice"
                dropped[sample] = reason
    dropped_groups = {g for r in reports for ids in r.dropped_groups.values() for g in ids}
    assert not dropped.keys() & set(batched)

    opened = {e.session_id: e for e in events if isinstance(e, SessionOpened)}
    finished = {e.session_id for e in events if isinstance(e, SessionFinished)}
    closed = {e.group_id for e in events if isinstance(e, GroupClosed)}

    def dropped_as(session: str) -> str | None:
        """A session is dropped by id, or by its sample's name if its group was closed
        before it opened."""
        o = opened[session]
        return dropped.get(session) or dropped.get(f"{o.group_id}/{o.sample_index}")

    # every session is trained, dropped with a reason, or pending (its group undecided)
    decided = batched_groups | dropped_groups | closed
    fate: dict[str, list[str]] = {}
    for session, o in opened.items():
        if session in batched:
            outcome = "trained"
        elif reason := dropped_as(session):
            outcome = f"dropped: {reason}"
        else:
            assert o.group_id not in decided, f"{session} of {o.group_id} is unaccounted for"
            outcome = "pending"
        fate.setdefault(outcome, []).append(session)
    assert set(fate.get("trained", [])) == set(batched) <= finished
    pending_groups = {opened[s].group_id for s in fate.get("pending", [])}
    assert len(pending_groups) <= GROUPS_PER_BATCH * (config.max_batches_ahead + 1)
    figures = {outcome: len(sessions) for outcome, sessions in sorted(fate.items())}
    print(
        f"\nfaults: restarts {summary.restarts}; {len(opened)} sessions opened "
        f"({len(finished)} finished): {figures}; {len(closed)} groups closed, "
        f"{len(dropped_groups)} groups dropped; run {summary.wall_s:.0f}s"
    )
    return replicas
