"""The trajectory service's data algorithms and stage schedule, against a real nats-server.

The test plays the agents and the gateway: it claims samples on ``task.claim`` and
writes the trajectory events a gateway would write to the durable stream. Restarts stop
the service and start a fresh one on the same run.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from seamlessflow.batches import stored_batches
from seamlessflow.bus import Bus, Unrecoverable, connect
from seamlessflow.protocol import (
    BatchFilterReport,
    BatchProgress,
    EpochFilterReport,
    GroupClosed,
    NoTask,
    RewardReported,
    SessionFinished,
    SessionOpened,
    Subjects,
    TaskAssignment,
    TaskClaim,
    TrainBatch,
    TrainStepMetrics,
    TrajectoryEvent,
    TurnRecorded,
    decode,
    encode,
)
from seamlessflow.rewards import register_reward
from seamlessflow.service import unrecoverable_cause
from seamlessflow.tasks import TaskItem, TaskSource, get_task_source
from sf_trajectory import schedule
from sf_trajectory.service import TrajectoryService
from sf_trajectory.settings import TrajectorySettings
from tests.support import InProcessMesh, announce_plan, write_outside_filter


@dataclass
class SixPrompts:
    """A task source small enough to finish epochs in a test."""

    name: str = "six"
    reward_fn: str = "integer_match"

    def items(self, split: str) -> list[TaskItem]:
        return [
            TaskItem(
                task_id=f"p{i}", messages=({"role": "user", "content": f"{i}?"},), reference="1"
            )
            for i in range(6)
        ]


class GatedVerifier:
    """A task verifier that waits, as a sandbox or a judge service does: an answer
    "slow" holds its worker thread until ``gate`` opens. Scores 1 for any answer."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.waiting = 0
        self.lock = threading.Lock()

    def __call__(self, completion: str, reference: str) -> float:
        if completion == "slow":
            with self.lock:
                self.waiting += 1
            self.gate.wait(30)
        return 1.0


GATED = GatedVerifier()
register_reward("test_gated_verifier")(GATED)


@pytest.fixture
def six_prompts(monkeypatch: pytest.MonkeyPatch) -> None:
    def sources(name: str, seed: int = 0) -> TaskSource:
        if name == "gated":
            return SixPrompts(name="gated", reward_fn="test_gated_verifier")
        return SixPrompts() if name == "six" else get_task_source(name, seed)

    monkeypatch.setattr(schedule, "get_task_source", sources)


class Trajectory:
    """One trajectory service of the test's run, restartable. ``steps``: the step budget
    the test's trainer announces (TrainingPlanned) before the first start; None: none."""

    def __init__(
        self, nats_url: str, run_id: str, settings: TrajectorySettings, steps: int | None
    ) -> None:
        self.nats_url, self.run_id, self.settings = nats_url, run_id, settings
        self.steps = steps
        self.mesh: InProcessMesh | None = None
        self.service = TrajectoryService(settings)

    async def start(self) -> TrajectoryService:
        if self.steps is not None:
            trainer = await connect(self.nats_url, Subjects(self.run_id), name="test-trainer")
            try:
                await trainer.ensure_streams()
                await announce_plan(trainer, self.steps)
            finally:
                await trainer.drain()
            self.steps = None  # announced once, as a trainer does (it stays in the stream)
        self.mesh = InProcessMesh(self.nats_url, self.run_id, None)
        self.service = await self.mesh.start(TrajectoryService(self.settings))
        await asyncio.wait_for(self.service.ready.wait(), 30)
        return self.service

    async def restart(self) -> TrajectoryService:
        await self.stop()
        return await self.start()

    async def stop(self) -> None:
        mesh, self.mesh = self.mesh, None
        if mesh is not None:
            await mesh.stop()


@pytest.fixture
async def trajectory(nats_url: str, run_id: str) -> AsyncIterator[Callable[..., Trajectory]]:
    started: list[Trajectory] = []

    def make(steps: int | None = None, **settings: object) -> Trajectory:
        started.append(Trajectory(nats_url, run_id, TrajectorySettings(**settings), steps))  # type: ignore[arg-type]
        return started[-1]

    yield make
    for service in started:
        await service.stop()


async def claim(bus: Bus) -> TaskAssignment | NoTask:
    return await bus.request(
        bus.subjects.task_claim(), TaskClaim(runner_id="test"), TaskAssignment | NoTask
    )


async def claim_group(bus: Bus, size: int) -> list[TaskAssignment]:
    claims = [await claim(bus) for _ in range(size)]
    assert all(isinstance(c, TaskAssignment) for c in claims), claims
    return claims  # type: ignore[return-value]


async def play(
    bus: Bus, task: TaskAssignment, *, reward: float | None = None, answer: str = "x"
) -> None:
    """What the gateway records for one agent session: opened, one turn, finished. With
    ``reward`` the agent reports it; else the task's verifier scores ``answer``."""
    session = "s" + uuid.uuid4().hex[:12]
    events: list[SessionOpened | TurnRecorded | RewardReported | SessionFinished] = [
        SessionOpened(
            session_id=session,
            task_id=task.task_id,
            group_id=task.group_id,
            sample_index=task.sample_index,
            group_size=task.group_size,
            reference=task.reference,
            reward_fn=task.reward_fn,
        ),
        TurnRecorded(
            session_id=session,
            turn_index=0,
            request_id=session,
            engine_id="e",
            prompt_ids=[1, 2],
            completion_ids=[3],
            logprobs=[-0.5],
            versions=[0],
            finish_reason="stop",
            completion_text=answer,
        ),
    ]
    if reward is not None:
        events.append(RewardReported(session_id=session, reward=reward))
    events.append(SessionFinished(session_id=session))
    for event in events:
        await bus.js_publish(bus.subjects.trajectory_event(session), event)


async def batches_published(traj: Trajectory, count: int, timeout: float = 10.0) -> None:
    await until(lambda: traj.service.next_batch_index >= count, timeout)


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110 (polling the service under test)
            await asyncio.sleep(0.02)


async def batches(bus: Bus) -> list[TrainBatch]:
    return await stored_batches(bus)


async def reports(bus: Bus, subject: str, report_type: type) -> list:  # type: ignore[type-arg]
    """Every data filter report on ``subject`` (in the run's metrics stream)."""
    messages = await bus.read_subject(bus.subjects.stream_metrics(), subject)
    return [decode(m.data, report_type) for m in messages]


# --------------------------------------------------------------------------- dynamic sampling


async def test_a_zero_variance_group_is_dropped_and_refilled_so_the_batch_stays_full(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    traj = trajectory(
        group_size=2,
        groups_per_batch=2,
        steps=1,
        max_batches_ahead=0,
        data_filters="staleness,dynamic_sampling",
    )
    service = await traj.start()
    flat, signal = await claim_group(bus, 2), await claim_group(bus, 2)
    # the budget: two groups; no more before a batch is published (one may be refilled)
    assert (await claim(bus)) == NoTask(reason="backpressure", retry_after_s=0.5)
    for task, reward in zip(flat + signal, (1.0, 1.0, 1.0, 0.0), strict=True):
        await play(bus, task, reward=reward)
    await until(lambda: service.grouper.groups_lost == 1)

    refill = await claim_group(bus, 2)  # the refill of the zero-variance group
    assert refill[0].group_id == "g0000002"
    assert (await claim(bus)) == NoTask(reason="backpressure", retry_after_s=0.5)
    for task, reward in zip(refill, (0.0, 1.0), strict=True):
        await play(bus, task, reward=reward)
    await batches_published(traj, 1)
    assert (await claim(bus)) == NoTask(reason="exhausted")

    s = bus.subjects
    [batch] = await batches(bus)
    assert [g.group_id for g in batch.groups] == ["g0000001", "g0000002"]
    [report] = await reports(bus, s.data_batch_report(), BatchFilterReport)
    assert (report.batch_index, report.groups_kept, report.samples_kept) == (0, 2, 4)
    assert report.groups_dropped == {"zero_variance": 1}
    assert report.samples_dropped == {"zero_variance": 2}
    assert report.stage == "arithmetic"


async def test_a_data_filter_from_outside_the_repo_drops_groups_in_the_running_service(
    bus: Bus, trajectory, tmp_path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """The plug-in contract end to end: listed by its dotted path, its key set under its
    name, it judges the service's groups; a group it drops is refilled and reported with
    its reason, as a built-in's would be."""
    path = write_outside_filter(tmp_path, monkeypatch)
    traj = trajectory(
        group_size=2,
        groups_per_batch=1,
        steps=1,
        max_batches_ahead=0,
        data_filters=f"staleness,{path}",
        data_filter={"low_reward": {"min_mean_reward": 0.75}},
    )
    service = await traj.start()
    for rewards in ((1.0, 0.0), (1.0, 1.0)):  # mean 0.5: dropped; 1.0: kept
        group = await claim_group(bus, 2)
        for task, reward in zip(group, rewards, strict=True):
            await play(bus, task, reward=reward)
    await batches_published(traj, 1)

    assert service.grouper.groups_lost == 1
    [batch] = await batches(bus)
    assert [g.group_id for g in batch.groups] == ["g0000001"]
    [report] = await reports(bus, bus.subjects.data_batch_report(), BatchFilterReport)
    assert report.groups_dropped == {"low_reward": 1}
    assert report.samples_dropped == {"low_reward": 2}


async def test_each_ready_group_of_the_next_batch_is_announced_as_progress(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """BatchProgress (the tag-scheduler's hint for an early reclaim): one message each
    time another group of the batch being formed passed the group filters; the group
    that completes the batch is announced by the batch itself."""
    seen: list[BatchProgress] = []

    async def on_progress(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(decode(msg.data, BatchProgress))

    await bus.nc.subscribe(bus.subjects.batch_progress(), cb=on_progress)
    traj = trajectory(group_size=2, groups_per_batch=3, steps=1, max_batches_ahead=0)
    await traj.start()
    groups = [await claim_group(bus, 2) for _ in range(3)]
    for count, group in enumerate(groups, start=1):
        for task, reward in zip(group, (1.0, 0.0), strict=True):
            await play(bus, task, reward=reward)
        if count < 3:
            await until(lambda count=count: len(seen) == count)  # type: ignore[misc]
    await batches_published(traj, 1)
    await bus.nc.flush()
    assert [(p.batch_index, p.groups_ready, p.groups_per_batch) for p in seen] == [
        (0, 1, 3),
        (0, 2, 3),
    ]
    assert {p.policy for p in seen} == {bus.subjects.policy}


async def published(bus: Bus, batch_index: int, version: int) -> None:
    """What the trainer sends once it stored ``version``, trained on ``batch_index``."""
    metrics = TrainStepMetrics(
        step=version, version=version, batch_index=batch_index, mean_reward=0.5, loss=0.1,
        clip_fraction=0.0, samples=4, tokens_generated=4, tokens_trained=4,
        max_staleness=0, step_seconds=0.1, wait_seconds=0.0, publish_seconds=0.1,
        policy=bus.subjects.policy,
    )  # fmt: skip
    await bus.js_publish(bus.subjects.train_metrics(), metrics)


@pytest.mark.parametrize("ahead", [0, 1])
async def test_a_synchronous_run_serves_each_batch_on_the_version_published_before_it(
    bus: Bus, trajectory, ahead: int
) -> None:  # type: ignore[no-untyped-def]
    """With ``max_batches_ahead=0`` every assignment names the version the trainer
    published last as its floor (engines still loading it must not serve the batch on
    the version before); with a lead, staleness is allowed and no floor is set."""
    traj = trajectory(group_size=2, groups_per_batch=1, steps=3, max_batches_ahead=ahead)
    service = await traj.start()
    first = await claim_group(bus, 2)
    assert {t.min_version for t in first} == {0}
    for task, reward in zip(first, (1.0, 0.0), strict=True):
        await play(bus, task, reward=reward)
    await batches_published(traj, 1)
    await published(bus, batch_index=0, version=1)
    await until(lambda: service.lines[bus.subjects.policy].trained_batches == 1)
    second = await claim_group(bus, 2)
    assert {t.min_version for t in second} == {1 if ahead == 0 else 0}


async def test_a_trainer_with_another_seed_stops_the_trajectory_service(
    nats_url: str, run_id: str, bus: Bus
) -> None:
    """One seed for the run (``SF_SEED``): the task order here and the trainer's
    evaluation split. A trainer that announced another ends the service with one line
    naming both, at start or later."""
    await announce_plan(bus, steps=2, seed=5)
    mesh = InProcessMesh(nats_url, run_id, None)
    try:
        await mesh.start(TrajectoryService(TrajectorySettings(group_size=2)))
        [(_, _, task)] = mesh.running
        with pytest.raises(Unrecoverable, match="SF_SEED=5 but this trajectory service has"):
            await asyncio.wait_for(task, 30)  # type: ignore[arg-type]
    finally:
        with contextlib.suppress(Unrecoverable):  # the ended service's error, again
            await mesh.stop()


async def test_a_later_plan_with_another_seed_also_stops_it(bus: Bus, trajectory) -> None:  # type: ignore[no-untyped-def]
    traj = trajectory(steps=3, group_size=2)
    service = await traj.start()
    assert service.lines[bus.subjects.policy].planned_steps == 3
    await announce_plan(bus, steps=4)  # a restarted trainer with a larger budget
    await until(lambda: service.dispatcher.total_groups == 4 * service.settings.groups_per_batch)
    await announce_plan(bus, steps=4, seed=1)
    assert traj.mesh is not None
    [(_, _, task)] = traj.mesh.running
    with pytest.raises(BaseException) as ended:  # in its loops' TaskGroup: an ExceptionGroup
        await asyncio.wait_for(task, 30)  # type: ignore[arg-type]
    cause = unrecoverable_cause(ended.value)
    assert cause is not None and "runs with SF_SEED=1" in str(cause), ended.value
    with contextlib.suppress(BaseException):  # the ended service's error, again
        await traj.stop()


# --------------------------------------------------------------------------- verifiers


@pytest.mark.usefixtures("six_prompts")
async def test_a_waiting_verifier_holds_back_only_its_own_sessions(bus: Bus, trajectory) -> None:  # type: ignore[no-untyped-def]
    """Verifications overlap (both of group A's at once) and a group whose verifier waits
    does not hold back another group's batch; A's batch follows once its verifier
    answers, with both samples scored."""
    GATED.gate.clear()
    GATED.waiting = 0
    traj = trajectory(task="gated", group_size=2, groups_per_batch=1, steps=2, max_batches_ahead=1)
    service = await traj.start()
    slow, fast = await claim_group(bus, 2), await claim_group(bus, 2)
    for task in slow:
        await play(bus, task, answer="slow")
    await until(lambda: GATED.waiting == 2)  # both of A's verifications run at once
    for task in fast:
        await play(bus, task, answer="fast")
    await batches_published(traj, 1)
    [first] = await batches(bus)
    assert [g.group_id for g in first.groups] == [fast[0].group_id]
    assert service.next_batch_index == 1 and GATED.waiting == 2

    GATED.gate.set()
    await batches_published(traj, 2)
    _, second = await batches(bus)
    [group] = second.groups
    assert group.group_id == slow[0].group_id
    assert sorted(s.reward for s in group.samples) == [1.0, 1.0]


# --------------------------------------------------------------------------- faults


async def test_a_stalled_group_is_closed_and_refilled_and_a_restart_resumes_mid_group(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """The agents of a group lose their gateway before they open a session: without a
    time-out the group would hold back the last batch forever (and the runner would have
    been told ``exhausted``). Then the service restarts with a group handed out in part:
    it hands out the rest, and reports no drop twice."""
    traj = trajectory(group_size=2, groups_per_batch=1, steps=2, group_timeout_s=2.0)
    service = await traj.start()
    await claim_group(bus, 2)  # g0: never opened
    for task in await claim_group(bus, 2):  # g1
        await play(bus, task, reward=1.0)
    await batches_published(traj, 1)
    assert (await claim(bus)) == NoTask(reason="backpressure", retry_after_s=0.5)
    await until(lambda: service.grouper.groups_lost == 1, timeout=10)

    [first] = await claim_group(bus, 1)  # the refill, g2, handed out in part
    assert (first.group_id, first.sample_index) == ("g0000002", 0)
    await play(bus, first, reward=0.0)
    await traj.restart()
    [rest] = await claim_group(bus, 1)
    assert (rest.group_id, rest.sample_index) == ("g0000002", 1)
    await play(bus, rest, reward=1.0)
    await batches_published(traj, 2)
    assert (await claim(bus)) == NoTask(reason="exhausted")

    s = bus.subjects
    events = [
        decode(m.data, TrajectoryEvent)
        for m in await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    ]
    assert [e.group_id for e in events if isinstance(e, GroupClosed)] == ["g0000000"]
    assert [[g.group_id for g in b.groups] for b in await batches(bus)] == [
        ["g0000001"],
        ["g0000002"],
    ]
    # the closed group is reported once, though the restart replayed its close
    named = [
        (reason, ids)
        for r in await reports(bus, s.data_batch_report(), BatchFilterReport)
        for reason, ids in (*r.dropped_samples.items(), *r.dropped_groups.items())
    ]
    assert named == [("timed_out", ["g0000000/0", "g0000000/1"]), ("no_samples", ["g0000000"])]


async def test_a_run_where_no_session_finishes_fails_loudly_instead_of_spinning(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """Agents claim samples but never open a session (a refused key, a wrong gateway
    URL): groups time out one after the other. Once no session has finished for
    ``stall_timeouts`` time-outs the service stops with an error that says so; one
    finished session before that restarts the count."""
    traj = trajectory(
        group_size=1, groups_per_batch=1, steps=100, group_timeout_s=0.5, stall_timeouts=4
    )
    service = await traj.start()
    assert traj.mesh is not None
    _, ctx, task = traj.mesh.running[0]
    await asyncio.sleep(1.5)  # nothing handed out: waiting for claims is no stall
    [first] = await claim_group(bus, 1)
    await play(bus, first, reward=1.0)  # one session finished: the stall clock restarts
    finished_at = asyncio.get_running_loop().time()
    with pytest.raises(BaseExceptionGroup) as failed:
        async with asyncio.timeout(30):
            while not task.done():  # type: ignore[attr-defined]
                await claim(bus)  # claimed, never opened: what a refused agent runner does
                await asyncio.sleep(0.1)
            task.result()  # type: ignore[attr-defined]
    waited = asyncio.get_running_loop().time() - finished_at
    assert waited >= 4 * 0.5, "the finished session must have restarted the count"
    stalled = unrecoverable_cause(failed.value)
    assert stalled is not None and "stalled" in str(stalled), failed.value
    assert service.timeouts.timeout_s == 0.5
    traj.mesh.running.clear()  # it already ended
    await ctx.bus.drain()  # type: ignore[attr-defined]
    traj.mesh = None


async def test_a_restart_after_retention_dropped_old_events_goes_on_where_it_was(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """Retention drops the oldest trajectory events (``SF_RETENTION_TRAJECTORY_*``); the
    batches outlive them. A restart then neither waits for the groups whose events are
    gone (they were done long ago) nor hands out a group id or batch index again."""
    traj = trajectory(
        group_size=2, groups_per_batch=1, steps=4, max_batches_ahead=4, group_timeout_s=600
    )
    await traj.start()
    for _ in range(2):  # g0, g1: a batch each
        for task in await claim_group(bus, 2):
            await play(bus, task, reward=1.0)
    await batches_published(traj, 2)
    s = bus.subjects
    stored = await bus.read_all(s.stream_trajectory(), s.trajectory_events_all())
    first_of_g1 = next(
        m.metadata.sequence.stream
        for m in stored
        if getattr(decode(m.data, TrajectoryEvent), "group_id", "") == "g0000001"
    )
    await traj.stop()

    await bus.js.purge_stream(s.stream_trajectory(), seq=first_of_g1)  # g0's events go
    service = await traj.start()
    assert service.timeouts.waiting == {}
    for task in await claim_group(bus, 2):
        assert task.group_id == "g0000002"
        await play(bus, task, reward=1.0)
    await batches_published(traj, 3)
    await traj.stop()

    await bus.js.purge_stream(s.stream_trajectory())  # every event goes
    service = await traj.start()
    assert service.timeouts.waiting == {}
    for task in await claim_group(bus, 2):
        assert task.group_id == "g0000003"
        await play(bus, task, reward=1.0)
    await batches_published(traj, 4)
    assert [(b.batch_index, [g.group_id for g in b.groups]) for b in await batches(bus)] == [
        (index, [f"g{index:07d}"]) for index in range(4)
    ]


# --------------------------------------------------------------------------- history resampling


# Epoch 0: per prompt, the rewards of its two samples.
EPOCH_0 = {
    "p0": (1.0, 1.0),  # all correct: dropped from epoch 1 on
    "p1": (1.0, 1.0),
    "p2": (1.0, 0.0),  # mixed: kept
    "p3": (0.0, 1.0),
    "p4": (0.0, 0.0),  # all wrong: kept
    "p5": (0.0, 0.0),
}


async def test_history_resampling_drops_solved_prompts_and_survives_a_restart(
    bus: Bus, trajectory, six_prompts
) -> None:  # type: ignore[no-untyped-def]
    traj = trajectory(
        task="six",
        group_size=2,
        groups_per_batch=2,
        max_batches_ahead=100,
        data_filters="history_resampling",
    )
    await traj.start()
    for _ in range(6):
        for task in await claim_group(bus, 2):
            await play(bus, task, reward=EPOCH_0[task.task_id][task.sample_index])
    await batches_published(traj, 3)

    # epoch 1, first half: the first group is solved this time, the second is not
    epoch_1 = [await claim_group(bus, 2) for _ in range(2)]
    for group, rewards in zip(epoch_1, ((1.0, 1.0), (0.0, 1.0)), strict=True):
        for task, reward in zip(group, rewards, strict=True):
            await play(bus, task, reward=reward)
    await batches_published(traj, 4)

    await traj.restart()
    epoch_1 += [await claim_group(bus, 2) for _ in range(2)]
    for group in epoch_1[2:]:
        for task in group:
            await play(bus, task, reward=0.0)
    await batches_published(traj, 5)
    epoch_2 = [(await claim_group(bus, 2))[0] for _ in range(3)]

    assert sorted(g[0].task_id for g in epoch_1) == ["p2", "p3", "p4", "p5"]
    assert [g[0].group_id for g in epoch_1] == [f"g{i:07d}" for i in range(6, 10)]
    solved_in_epoch_1 = epoch_1[0][0].task_id  # remembered across the restart
    assert sorted(t.task_id for t in epoch_2) == sorted(
        {"p2", "p3", "p4", "p5"} - {solved_in_epoch_1}
    )
    epochs = await reports(bus, bus.subjects.data_epoch_report(), EpochFilterReport)
    assert [(e.epoch, e.first_group, e.prompts) for e in epochs] == [
        (0, 0, 6),
        (1, 6, 4),
        (2, 10, 3),
    ]
    assert epochs[1].dropped == {"all_correct": 2}
    assert sorted(epochs[1].dropped_task_ids) == ["p0", "p1"]
    assert epochs[1].kept == {"mixed": 2, "all_wrong": 2}
    assert epochs[2].dropped_task_ids == [solved_in_epoch_1]


# --------------------------------------------------------------------------- stages


async def run_two_stages(bus: Bus, traj: Trajectory, *, restart: bool) -> list[TaskAssignment]:
    """lookup for batches 0-1, then arithmetic; one group of two samples per batch."""
    await traj.start()
    handed: list[TaskAssignment] = []
    for batch_index in range(3):
        group = await claim_group(bus, 2)
        handed += group
        if batch_index == 1:
            # group 2 is for batch 2, arithmetic's: it waits until batch 1 is published
            assert (await claim(bus)) == NoTask(reason="backpressure")
        for task in group:
            await play(bus, task, answer=task.reference)  # right, says the stage's verifier
        await batches_published(traj, batch_index + 1)
    if restart:
        await traj.restart()
    handed += await claim_group(bus, 2)
    return handed


async def test_the_stage_switches_exactly_at_its_batch_and_a_restart_resumes_in_it(
    nats_url: str, bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    stages = dict(
        stages="lookup:2,arithmetic",
        group_size=2,
        groups_per_batch=1,
        max_batches_ahead=5,
        data_filters="",
    )
    handed = await run_two_stages(bus, trajectory(**stages), restart=True)

    lookup, arithmetic = get_task_source("lookup"), get_task_source("arithmetic")
    assert [t.reward_fn for t in handed] == [lookup.reward_fn] * 4 + [arithmetic.reward_fn] * 4
    s = bus.subjects
    trained = await batches(bus)
    lookup_ids = {i.task_id for i in lookup.items("train")}
    assert [all(g.task_id in lookup_ids for g in b.groups) for b in trained] == [True, True, False]
    assert all(s.reward == 1.0 for b in trained for g in b.groups for s in g.samples)
    assert [r.stage for r in await reports(bus, s.data_batch_report(), BatchFilterReport)] == [
        "lookup",
        "lookup",
        "arithmetic",
    ]
    epochs = await reports(bus, s.data_epoch_report(), EpochFilterReport)
    assert [(e.stage, e.epoch, e.first_group) for e in epochs] == [
        ("lookup", 0, 0),
        ("arithmetic", 0, 2),
    ]
    assert handed[-1].group_id == "g0000003"

    # after the restart: the very samples an uninterrupted service hands out (another run)
    other_run = "t" + uuid.uuid4().hex[:12]
    control_bus = await connect(nats_url, Subjects(other_run), name="control")
    await control_bus.ensure_streams()
    control = Trajectory(nats_url, other_run, TrajectorySettings(**stages), None)  # type: ignore[arg-type]
    try:
        uninterrupted = await run_two_stages(control_bus, control, restart=False)
    finally:
        await control.stop()
        await control_bus.drain()
    assert [t.task_id for t in handed] == [t.task_id for t in uninterrupted]


async def test_a_claim_repeated_after_its_reply_was_lost_gets_the_same_sample(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """A sample handed to a claim whose reply never arrived is not lost: the runner
    repeats the claim (same id) and gets it, and the group fills up with no time-out."""
    await trajectory(group_size=4, groups_per_batch=1, steps=1).start()

    async def claim_as(claim_id: str) -> TaskAssignment | NoTask:
        return await bus.request(
            bus.subjects.task_claim(),
            TaskClaim(runner_id="test", claim_id=claim_id),
            TaskAssignment | NoTask,
        )

    first = await claim_as("a")
    assert isinstance(first, TaskAssignment)
    assert await claim_as("a") == first  # the repeat of a claim whose reply was lost
    others = [await claim_as(name) for name in ("b", "c", "d")]
    assert all(isinstance(o, TaskAssignment) for o in others), others
    indexes = {first.sample_index, *(o.sample_index for o in others)}  # type: ignore[union-attr]
    assert indexes == {0, 1, 2, 3}
    assert {o.group_id for o in others} == {first.group_id}  # type: ignore[union-attr]


async def test_the_agent_runner_repeats_an_unanswered_claim_with_the_same_id(
    nats_url: str, run_id: str
) -> None:
    """The trajectory service answers a claim late (it waited behind others, under
    load): the runner's repeat must name the same claim, so it gets that sample."""
    from seamlessflow.protocol import Subjects
    from sf_agents.service import AgentRunner

    service = await connect(nats_url, Subjects(run_id), name="slow-trajectory")
    claims: list[TaskClaim] = []

    async def answer(msg) -> None:  # type: ignore[no-untyped-def]
        claims.append(decode(msg.data, TaskClaim))
        if len(claims) == 1:
            return  # the first claim's reply never arrives in time
        await msg.respond(encode(NoTask(reason="exhausted")))

    await service.nc.subscribe(service.subjects.task_claim(), cb=answer)
    runner_bus = await connect(nats_url, Subjects(run_id), name="agents")
    runner = AgentRunner()
    runner.ctx = type("Ctx", (), {"bus": runner_bus, "subjects": runner_bus.subjects})()  # type: ignore[assignment]
    try:
        await asyncio.wait_for(runner._worker(), 30)  # returns on "exhausted"
    finally:
        await runner_bus.drain()
        await service.drain()
    assert len(claims) == 2
    assert claims[0].claim_id and claims[1].claim_id == claims[0].claim_id


async def test_a_group_missing_one_sample_times_out_and_fills_the_last_batch(
    bus: Bus, trajectory
) -> None:  # type: ignore[no-untyped-def]
    """The compose cluster check's first stall: in the run's last batch, a group whose
    other samples finished and one was claimed but never opened (its agent runner gave
    up on the gateway during a NATS leader election). It must time out and close with
    the samples it has, so the last batch forms."""
    traj = trajectory(group_size=3, groups_per_batch=1, steps=1, group_timeout_s=1.0)
    await traj.start()
    first, second, lost = await claim_group(bus, 3)
    assert lost.group_id == first.group_id
    await play(bus, first, reward=1.0)
    await play(bus, second, reward=0.0)
    await batches_published(traj, 1, timeout=15)
    [batch] = await batches(bus)
    assert [len(g.samples) for g in batch.groups] == [2]
