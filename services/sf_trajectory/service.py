"""trajectory: the trajectory manager and the rollout rhythm.

Consumes:
- ``sf.<run>.traj.export`` (request SessionExportQuery -> reply SessionExport: every
  branch of one session, rebuilt from its stored events)
- ``sf.<run>.traj.event.<session>`` (JetStream ``SF_<RUN>_TRAJ``: SessionOpened,
  TurnRecorded, RewardReported, SessionFinished from the gateway) and
  ``sf.<run>.traj.event.group.<group>`` (GroupClosed, its own), replayed from the
  stream's start on every start-up, so a restart rebuilds exactly the open sessions
- ``sf.<run>.task.claim`` (request TaskClaim -> reply TaskAssignment | NoTask)
- ``sf.<run>.train.<policy>.metrics`` (TrainStepMetrics: how far each policy's trainer
  has consumed)
- ``sf.<run>.data.epoch`` (JetStream ``SF_<RUN>_METRICS``: its own EpochFilterReports,
  read once on start-up to rebuild every epoch's prompt order) and
  ``sf.<run>.data.<policy>.batch`` (its own BatchFilterReports, read once on start-up:
  what was reported dropped is not reported again)
Produces, for each policy of the run (``SF_POLICIES``):
- ``sf.<run>.batch.<policy>.payload.<index>`` (JetStream ``SF_<RUN>_BATCHDATA-<policy>``:
  the batch's TrainBatch, packed and in chunks, ``seamlessflow.batches``), then
  ``sf.<run>.batch.<policy>.ready`` (JetStream ``SF_<RUN>_BATCH-<policy>``: BatchReady,
  message id ``MessageIds.batch`` so a re-publish after a restart lands once)
- ``sf.<run>.data.<policy>.batch`` (JetStream ``SF_<RUN>_METRICS``: BatchFilterReport
  after each batch, message id ``MessageIds.data_batch_report``)
- ``sf.<run>.batch.<policy>.progress`` (core NATS: BatchProgress each time another
  group of the batch being formed passed the group filters; the tag-scheduler's hint
  for taking lent engines back early)
and once for the run:
- ``sf.<run>.data.epoch`` (JetStream ``SF_<RUN>_METRICS``: EpochFilterReport when an
  epoch or stage starts, message id ``MessageIds.data_epoch_report``; published before
  the claim that opens the epoch is answered)
- ``sf.<run>.traj.event.group.<group>`` (JetStream ``SF_<RUN>_TRAJ``: GroupClosed when
  a group handed out made no progress for ``SF_TRAJECTORY_GROUP_TIMEOUT_S``, see
  ``timeouts``; message id ``closed-<group>``)

Data algorithms (``data_filters``) and the stage schedule (``schedule``) are configured
by ``SF_TRAJECTORY_DATA_FILTERS`` and ``SF_TRAJECTORY_STAGES``.

Multi-policy: each policy is a ``PolicyLine`` with its own grouper, group filters,
batch indexes and trainer progress; a session gives each policy the sample of the
turns that policy made. Tasks and epochs are shared: the dispatcher's rhythm follows
the slowest trainer, refills for the policy that lost the most groups, and switches
stage once every policy published the earlier stages' batches. A policy whose trainer
finished its steps no longer sets the pace. SRPO's history
resampling follows the task's policy (the first), whose answers the tasks score.

Durability (docs/architecture.md, invariant 4): a session that is in a published batch
is never batched again (the batch stream is read at start-up); a completed session that
is not yet in a batch is rebuilt from the event stream. Every sample the service drops
is named in one batch report (``BatchFilterReport.dropped_samples``), also across
restarts.

A stalled run fails loudly: when groups time out and no session has finished for
``SF_TRAJECTORY_STALL_TIMEOUTS`` time-outs, the service exits with that error (exit code
78) instead of handing out groups that time out forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from seamlessflow import telemetry
from seamlessflow.batches import publish_batch, stored_announcements
from seamlessflow.bus import Msg, NotFound, Subscription, Unrecoverable
from seamlessflow.protocol import (
    BatchFilterReport,
    BatchProgress,
    EpochFilterReport,
    GroupClosed,
    MessageIds,
    NoTask,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    Subjects,
    TaskAssignment,
    TaskClaim,
    TrainBatch,
    TrainingFinished,
    TrainingPlanned,
    TrainStepMetrics,
    TrajectoryEvent,
    decode,
)
from seamlessflow.rewards import RewardFn, get_reward, reward_names
from seamlessflow.service import ServiceContext, supervise
from sf_trajectory.data_filters import DataFilters
from sf_trajectory.dispatch import Dispatcher, group_id, group_index
from sf_trajectory.grouping import Grouper, export_session
from sf_trajectory.schedule import build_stages, stage_of_batch
from sf_trajectory.settings import TrajectorySettings
from sf_trajectory.timeouts import GroupTimeouts

log = logging.getLogger(__name__)

ANSWERED_CLAIMS_KEPT = 4096
"""Assignments remembered for repeated claims (``TaskClaim.claim_id``)."""
tracer = telemetry.tracer(__name__)


@dataclass
class PolicyLine:
    """One policy's side of the trajectory service: its samples, groups and batches."""

    subjects: Subjects
    grouper: Grouper
    next_batch_index: int = 0
    """Index of the next batch this policy's trainer gets (= the version training it)."""
    trained_batches: int = 0
    """Batches the policy's trainer has consumed (from its metrics)."""
    published_version: int = 0
    """The weight version its trainer published last (from its metrics, which it sends
    once the version is stored): what a synchronous run's next samples are served on."""
    finished: bool = False
    """Its trainer reached its step budget (TrainingFinished): it no longer sets the pace."""
    progress_reported: tuple[int, int] = (0, 0)
    """The last BatchProgress published: (batch index, groups ready)."""
    planned_steps: int | None = None
    """The step budget its trainer announced last (TrainingPlanned); None: not yet."""

    @property
    def policy(self) -> str:
        return self.subjects.policy


class TrajectoryService:
    name = "trajectory"

    def __init__(self, settings: TrajectorySettings | None = None) -> None:
        self.settings = settings or TrajectorySettings()
        self.lines: dict[str, PolicyLine] = {}
        """Policy name -> its line, the task's policy first."""
        self.malformed_events = 0
        self.timeouts = GroupTimeouts(self.settings.group_timeout_s)
        self._last_finished = time.monotonic()
        """When a session of the run last finished (or this service started)."""
        self.ready = asyncio.Event()
        self._applying = asyncio.Lock()
        """One event applied at a time (``_apply``)."""
        self._session_tails: dict[str, asyncio.Task[None]] = {}
        """Session -> the last of its events still waiting to be applied."""
        self._session_groups: dict[str, str] = {}
        """Session -> its group, from its SessionOpened until its SessionFinished is
        applied (a group's close waits for its sessions' pending events)."""
        self._pending: asyncio.TaskGroup | None = None
        self._verify_slots = asyncio.Semaphore(self.settings.verify_concurrency)
        self._verifier_threads = ThreadPoolExecutor(
            self.settings.verify_concurrency, thread_name_prefix="verifier"
        )
        self._plan_error: Unrecoverable | None = None
        self._plan_failed = asyncio.Event()
        self._claims = asyncio.Lock()
        """One claim at a time: an epoch's record is durable before its first group is
        handed out, and no other claim slips in while it is being published."""
        self._answered: OrderedDict[str, TaskAssignment] = OrderedDict()
        """The latest assignments by claim id: a repeated claim gets its sample again
        (bounded: a runner repeats a claim within seconds, not thousands of claims later)."""

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        subjects = ctx.subjects
        self.stages = build_stages(self.settings.stage_specs(), ctx.mesh.seed)
        trusted = {stage.reward_fn for stage in self.stages} | {*self.settings.trusted_reward_fns()}
        self.reward_lookup = TrustedRewards(trusted)
        for policy in ctx.mesh.policy_names():
            line_subjects = subjects.for_policy(policy)
            filters = DataFilters.from_settings(self.settings.data_filter_names(), self.settings)
            grouper = Grouper(self.reward_lookup, filters=filters, policy=policy)
            line = PolicyLine(line_subjects, grouper)
            await self._load_batched_sessions(line)
            await self._load_reported_drops(line)
            line.trained_batches, line.published_version = await self._load_trained(line)
            # batch indices never repeat, even once retention dropped every batch: the
            # trainer skips a batch at or below the last one it trained
            line.next_batch_index = max(line.next_batch_index, line.trained_batches)
            line.finished = await self._trainer_finished(line)
            plan = await self._last_plan(line)
            if plan is not None:
                self._check_plan(plan)
                line.planned_steps = plan.steps
            self.lines[policy] = line

        events, last_seq = await ctx.bus.follow(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
        max_group = -1
        min_group: int | None = None
        """The lowest group with an event still stored (retention drops the oldest)."""
        seen_groups: set[str] = set()
        last_sample: dict[str, int] = {}
        """Group -> the highest sample index that opened a session."""
        replayed = 0
        async with self._applying_events():  # on leaving, every replayed event is applied
            while last_seq:
                msg = await events.next_msg(timeout=10.0)
                replayed += 1
                event = self._decode_event(msg)
                if event is not None:
                    if isinstance(event, SessionOpened | GroupClosed):
                        index = group_index(event.group_id)
                        max_group = max(max_group, index)
                        if index >= 0:
                            min_group = index if min_group is None else min(min_group, index)
                        seen_groups.add(event.group_id)
                    if isinstance(event, SessionOpened):
                        last_sample[event.group_id] = max(
                            last_sample.get(event.group_id, -1), event.sample_index
                        )
                    await self._apply(event)
                if msg.metadata.sequence.stream >= last_seq:
                    break
        # Group ids never repeat either: the batches still stored name groups whose
        # events retention may have dropped.
        batched_max = max(
            (group_index(g) for line in self.lines.values() for g in line.grouper.finished_groups),
            default=-1,
        )
        # The last group may have been handed out in part when the service stopped: its
        # remaining samples are handed out now (a claim answered before the stop has
        # opened its session by the time the replay runs), instead of waiting for its
        # time-out. A closed group is done.
        next_group, next_sample = max(max_group, batched_max) + 1, 0
        resumed = last_sample.get(group_id(max_group), -1) + 1
        if (
            max_group > batched_max
            and 0 < resumed < self.settings.group_size
            and self._still_open(group_id(max_group))
        ):
            next_group, next_sample = max_group, resumed
        # Groups below the last one seen were handed out; one that never opened a session
        # (every claim's reply or session was lost) waits like any other for its time-out.
        # Groups below the first one stored are older than the stream's retention: done.
        for index in range(min_group or 0, max_group + 1):
            if group_id(index) not in seen_groups:
                self.timeouts.progress(
                    group_id(index), "", self.settings.group_size, time.monotonic()
                )
        for line in self.lines.values():
            log.info(
                "%s: replayed %d events; %d sessions open, %d batches published, %d trained",
                line.policy, replayed, len(line.grouper.sessions), line.next_batch_index,
                line.trained_batches,
            )  # fmt: skip

        self.dispatcher = Dispatcher(
            self.stages,
            group_size=self.settings.group_size,
            groups_per_batch=self.settings.groups_per_batch,
            total_batches=self._step_budget(),
            max_batches_ahead=self.settings.max_batches_ahead,
            seed=ctx.mesh.seed,
            next_group=next_group,
            next_sample=next_sample,
            data_filters=self.task_line.grouper.filters,
            recorded_epochs=await self._load_epoch_reports(),
            task_policy=self.task_line.policy,
        )
        log.info(
            "policies: %s; data filters: %s; stages: %s; next group %d (sample %d)",
            ",".join(self.lines),
            ",".join(self.task_line.grouper.filters.names) or "none",
            ", ".join(f"{s.name} from batch {s.first_batch}" for s in self.stages),
            self.dispatcher.next_group,
            self.dispatcher.next_sample,
        )
        for line in self.lines.values():
            await ctx.bus.subscribe(
                line.subjects.train_metrics(), TrainStepMetrics, self._train_metrics_handler(line)
            )
            await ctx.bus.subscribe(
                line.subjects.train_finished(),
                TrainingFinished,
                self._train_finished_handler(line),
            )
            await ctx.bus.subscribe(
                line.subjects.train_plan(), TrainingPlanned, self._train_plan_handler(line)
            )
        await ctx.bus.serve(subjects.task_claim(), TaskClaim, self.on_claim)
        await ctx.bus.serve(subjects.trajectory_export(), SessionExportQuery, self.on_export)
        self.ready.set()
        try:
            await supervise(
                ctx.stopping, self._event_loop(events), self._timeout_loop(), self._plan_watch()
            )
        finally:
            self._verifier_threads.shutdown(wait=False, cancel_futures=True)

    @property
    def task_line(self) -> PolicyLine:
        """The task's policy: the tasks' reward functions score its answers."""
        return next(iter(self.lines.values()))

    @property
    def grouper(self) -> Grouper:
        """The task policy's grouper (the only one in a single-policy run)."""
        return self.task_line.grouper

    def _pacing(self) -> list[PolicyLine]:
        """The lines that set the rollout rhythm: those whose trainer still trains (all
        of them once every one finished)."""
        training = [line for line in self.lines.values() if not line.finished]
        return training or list(self.lines.values())

    @property
    def next_batch_index(self) -> int:
        """Batches published for every pacing policy (the fewest)."""
        return min(line.next_batch_index for line in self._pacing())

    @property
    def trained_batches(self) -> int:
        """Batches every pacing policy's trainer consumed (the slowest trainer's)."""
        return min(line.trained_batches for line in self._pacing())

    async def on_claim(self, claim: TaskClaim) -> TaskAssignment | NoTask:
        async with self._claims:
            if claim.claim_id in self._answered:
                return self._answered[claim.claim_id]
            await self._record_epochs()  # left over if a publish failed
            # The rhythm of several policies: wait for the slowest trainer, refill for
            # the policy that lost the most groups, switch stage once every policy
            # published the earlier stages' batches.
            groups_lost = max(line.grouper.groups_lost for line in self._pacing())
            answer = self.dispatcher.claim(self.trained_batches, groups_lost, self.next_batch_index)
            await self._record_epochs()
            if isinstance(answer, TaskAssignment) and self.settings.max_batches_ahead == 0:
                # synchronous: every group of this batch was dispatched after the version
                # it must be generated on was stored; engines may still be loading it
                line = self.lines.get(answer.policy)
                if line is not None:
                    answer.min_version = line.published_version
            if isinstance(answer, TaskAssignment):
                self.timeouts.progress(
                    answer.group_id, answer.task_id, answer.group_size, time.monotonic()
                )
                if claim.claim_id:
                    self._answered[claim.claim_id] = answer
                    while len(self._answered) > ANSWERED_CLAIMS_KEPT:
                        self._answered.popitem(last=False)
            return answer

    async def _record_epochs(self) -> None:
        while self.dispatcher.unrecorded_epochs:
            report = self.dispatcher.unrecorded_epochs[0]
            with tracer.start_as_current_span(
                "trajectory.epoch",
                attributes={
                    "stage": report.stage,
                    "epoch": report.epoch,
                    "epoch.first_group": report.first_group,
                    "epoch.prompts": report.prompts,
                    "epoch.kept_all": report.kept_all,
                    **_prefixed("epoch.kept", report.kept),
                    **_prefixed("epoch.dropped", report.dropped),
                },
            ):
                await self.ctx.bus.js_publish(
                    self.ctx.subjects.data_epoch_report(),
                    report,
                    msg_id=MessageIds.data_epoch_report(report.stage_index, report.epoch),
                )
            self.dispatcher.unrecorded_epochs.pop(0)
            log.info(
                "stage %s epoch %d from group %d: %d prompts; kept %s; dropped %s%s",
                report.stage, report.epoch, report.first_group, report.prompts,
                report.kept or "-", report.dropped or "-",
                " (every prompt would be dropped: all kept)" if report.kept_all else "",
            )  # fmt: skip

    async def on_export(self, query: SessionExportQuery) -> SessionExport:
        subjects = self.ctx.subjects
        messages = await self.ctx.bus.read_subject(
            subjects.stream_trajectory(), subjects.trajectory_event(query.session_id)
        )
        events = [e for e in (self._decode_event(m) for m in messages) if e is not None]
        if not events:
            raise NotFound(f"session {query.session_id!r} does not exist")
        return export_session(events, self.reward_lookup)

    async def _event_loop(self, events: Subscription) -> None:
        async with self._applying_events():
            while True:
                # No time-out: on Python 3.11, a cancellation that lands as next_msg's
                # time-out fires comes out of asyncio.wait_for as a TimeoutError, and a
                # loop that goes on after time-outs would never stop.
                msg = await events.next_msg(timeout=None)
                event = self._decode_event(msg)
                if event is not None:
                    await self._apply(event)

    def _decode_event(self, msg: Msg) -> TrajectoryEvent | None:
        try:
            event: TrajectoryEvent = decode(msg.data, TrajectoryEvent)
            return event
        except ValueError as exc:
            # Nobody awaits a reply on a stream; count it and move on (it changes nothing).
            self.malformed_events += 1
            log.warning("ignoring malformed trajectory event on %s: %s", msg.subject, exc)
            return None

    async def _timeout_loop(self) -> None:
        """Close the groups that stopped making progress (``timeouts``)."""
        while True:
            await asyncio.sleep(min(1.0, self.timeouts.timeout_s / 4))
            now = time.monotonic()
            expired = self.timeouts.expired(now)
            if expired:
                self._check_stalled(now, len(expired))
            for waiting in expired:
                log.warning("group %s made no progress for %.0fs: closing it",
                            waiting.group_id, self.timeouts.timeout_s)  # fmt: skip
                closed = GroupClosed(
                    group_id=waiting.group_id,
                    task_id=waiting.task_id,
                    group_size=waiting.group_size,
                )
                await self.ctx.bus.js_publish(
                    self.ctx.subjects.trajectory_group_event(waiting.group_id),
                    closed,
                    msg_id=MessageIds.group_closed(waiting.group_id),
                )

    def _check_stalled(self, now: float, timed_out: int) -> None:
        """Fail the run loudly when groups time out and nothing finishes any more."""
        limit = self.settings.stall_timeouts * self.timeouts.timeout_s
        idle = now - self._last_finished
        if self.settings.stall_timeouts and idle >= limit:
            raise Unrecoverable(
                f"the run is stalled: no session finished for {idle:.0f}s while "
                f"{timed_out} group(s) timed out (SF_TRAJECTORY_GROUP_TIMEOUT_S="
                f"{self.timeouts.timeout_s:.0f}); check that agents reach the gateway and "
                "engines answer (their logs)"
            )

    async def _apply(self, event: TrajectoryEvent) -> None:
        """Apply one event, in stream order for its session.

        Invariants: the events of one session are applied in the order the stream holds
        them, a group's close after every event of its sessions that came before it, and
        one event at a time (``_applying``: publishing a batch awaits). A finish that
        needs the task's verifier is verified in a worker thread first; meanwhile other
        sessions' events go on (and their verifications overlap, up to
        ``verify_concurrency``), while its own session's later events wait behind it
        (``_session_tails``). Events with nothing to wait for are applied at once.
        """
        waits_for = self._earlier_pending(event)
        if not waits_for and not self._verifications(event):
            async with self._applying:
                await self._apply_verified(event)
            return
        assert self._pending is not None, "events are applied inside _applying_events()"
        task = self._pending.create_task(self._apply_in_turn(event, waits_for))
        if not isinstance(event, GroupClosed):
            session = event.session_id
            self._session_tails[session] = task
            task.add_done_callback(lambda done: self._forget_tail(session, done))

    def _earlier_pending(self, event: TrajectoryEvent) -> list[asyncio.Task[None]]:
        """The pending applications ``event`` must come after."""
        if isinstance(event, GroupClosed):
            return [
                task
                for session, task in self._session_tails.items()
                if self._session_groups.get(session) == event.group_id
            ]
        if isinstance(event, SessionOpened):
            self._session_groups[event.session_id] = event.group_id
        tail = self._session_tails.get(event.session_id)
        return [tail] if tail is not None else []

    def _forget_tail(self, session: str, done: asyncio.Task[None]) -> None:
        if self._session_tails.get(session) is done:
            del self._session_tails[session]

    async def _apply_in_turn(
        self, event: TrajectoryEvent, waits_for: list[asyncio.Task[None]]
    ) -> None:
        if waits_for:
            await asyncio.wait(waits_for)  # a failure is the task group's to report
        verifications = self._verifications(event)  # after the session's earlier events
        if verifications:
            async with self._verify_slots:
                loop = asyncio.get_running_loop()
                await asyncio.gather(
                    *(loop.run_in_executor(self._verifier_threads, v) for v in verifications)
                )
        async with self._applying:
            await self._apply_verified(event)

    def _verifications(self, event: TrajectoryEvent) -> list[Callable[[], None]]:
        """What scores ``event`` before it is applied (the lines' task verifiers)."""
        calls = (line.grouper.pending_verification(event) for line in self.lines.values())
        return [call for call in calls if call is not None]

    @contextlib.asynccontextmanager
    async def _applying_events(self) -> AsyncIterator[None]:
        """Where events are applied: on leaving, every pending one has been; a failure
        to apply one (a publish that failed) ends the block with it."""
        async with asyncio.TaskGroup() as pending:
            self._pending = pending
            try:
                yield
            finally:
                self._pending = None

    async def _apply_verified(self, event: TrajectoryEvent) -> None:
        opened = self._opened_of(event)
        for line in self.lines.values():
            await self._apply_to(line, event)
        if isinstance(event, SessionFinished):
            self._session_groups.pop(event.session_id, None)
            self._last_finished = time.monotonic()
        elif isinstance(event, GroupClosed):  # its unfinished sessions will never finish
            for session in [s for s, g in self._session_groups.items() if g == event.group_id]:
                del self._session_groups[session]
        if opened is None:
            return
        if self._still_open(opened.group_id):
            self.timeouts.progress(
                opened.group_id, opened.task_id, opened.group_size, time.monotonic()
            )
        else:
            self.timeouts.done(opened.group_id)  # complete, closed, or batched before

    def _still_open(self, group: str) -> bool:
        """The group is waiting for samples (not complete, closed or batched)."""
        return any(group in line.grouper.groups for line in self.lines.values())

    def _opened_of(self, event: TrajectoryEvent) -> SessionOpened | GroupClosed | None:
        """What names the event's group (None: a session no line follows)."""
        if isinstance(event, SessionOpened | GroupClosed):
            return event
        for line in self.lines.values():
            session = line.grouper.sessions.get(event.session_id)
            if session is not None:
                return session.opened
        return None

    async def _apply_to(self, line: PolicyLine, event: TrajectoryEvent) -> None:
        grouper = line.grouper
        grouper.apply(event)
        while (
            groups := grouper.take_batch(
                self.settings.groups_per_batch, batch_index=line.next_batch_index
            )
        ) is not None:
            batch = TrainBatch(batch_index=line.next_batch_index, groups=groups, policy=line.policy)
            await self._publish_batch(line, batch)
            for group in groups:
                grouper.already_batched.update(s.session_id for s in group.samples)
            line.next_batch_index += 1
        progress = (line.next_batch_index, grouper.judged)
        if grouper.judged and progress != line.progress_reported:
            line.progress_reported = progress
            await self.ctx.bus.publish(
                line.subjects.batch_progress(),
                BatchProgress(
                    batch_index=line.next_batch_index,
                    groups_ready=grouper.judged,
                    groups_per_batch=self.settings.groups_per_batch,
                    policy=line.policy,
                ),
            )

    async def _publish_batch(self, line: PolicyLine, batch: TrainBatch) -> None:
        """The batch, then what the data filters did while it formed."""
        report = self._batch_report(line, batch)
        with tracer.start_as_current_span(
            "trajectory.batch",
            attributes={
                "policy": line.policy,
                "batch.index": batch.batch_index,
                "stage": report.stage,
                "batch.samples": report.samples_kept,
                **_prefixed("batch.groups_dropped", report.groups_dropped),
                **_prefixed("batch.samples_dropped", report.samples_dropped),
                **_prefixed("batch.groups_waived", report.groups_waived),
            },
        ):
            await publish_batch(self.ctx.bus, batch)
            # the metrics stream holds every policy's reports: the id names the policy
            await self.ctx.bus.js_publish(
                line.subjects.data_batch_report(),
                report,
                msg_id=MessageIds.data_batch_report(line.policy, batch.batch_index),
            )
        if report.groups_dropped or report.groups_waived or report.samples_dropped:
            log.info(
                "%s batch %d (%s): %d groups; groups dropped %s, waived %s; samples dropped %s",
                line.policy, batch.batch_index, report.stage, report.groups_kept,
                report.groups_dropped or "-", report.groups_waived or "-",
                report.samples_dropped or "-",
            )  # fmt: skip

    def _batch_report(self, line: PolicyLine, batch: TrainBatch) -> BatchFilterReport:
        tally = line.grouper.last_tally
        stage = self.stages[stage_of_batch(self.stages, batch.batch_index)]
        return BatchFilterReport(
            batch_index=batch.batch_index,
            stage=stage.name,
            policy=line.policy,
            groups_kept=len(batch.groups),
            samples_kept=sum(len(g.samples) for g in batch.groups),
            groups_dropped=dict(tally.groups_dropped),
            samples_dropped=dict(tally.samples_dropped),
            groups_waived=dict(tally.groups_waived),
            dropped_samples=dict(tally.dropped_samples),
            dropped_groups=dict(tally.dropped_groups),
        )

    async def _load_batched_sessions(self, line: PolicyLine) -> None:
        """What the policy's batch stream holds: never batched again (docs/architecture.md,
        invariant 4)."""
        for batch in await stored_announcements(self.ctx.bus, line.policy):
            for group in batch.groups:
                line.grouper.already_batched.update(s.session_id for s in group.samples)
                line.grouper.finished_groups.add(group.group_id)
                line.grouper.filters.observe(group)  # the replay skips these sessions
            line.next_batch_index = max(line.next_batch_index, batch.batch_index + 1)

    async def _load_reported_drops(self, line: PolicyLine) -> None:
        """What the policy's published batch reports counted as dropped: the replay
        rebuilds those drops, and they are not reported twice."""
        subjects = line.subjects
        reports = await self.ctx.bus.read_decoded(
            subjects.stream_metrics(), subjects.data_batch_report(), BatchFilterReport
        )
        for report in reports:
            for ids in (*report.dropped_samples.values(), *report.dropped_groups.values()):
                line.grouper.reported.update(ids)

    async def _load_epoch_reports(self) -> list[EpochFilterReport]:
        subjects = self.ctx.subjects
        return await self.ctx.bus.read_decoded(
            subjects.stream_metrics(), subjects.data_epoch_report(), EpochFilterReport
        )

    async def _load_trained(self, line: PolicyLine) -> tuple[int, int]:
        """Batches the trainer consumed and the version it published last (a restart)."""
        subjects = line.subjects
        metrics = await self.ctx.bus.read_decoded(
            subjects.stream_metrics(), subjects.train_metrics(), TrainStepMetrics
        )
        batches = max((m.batch_index + 1 for m in metrics), default=0)
        return batches, max((m.version for m in metrics), default=0)

    async def _trainer_finished(self, line: PolicyLine) -> bool:
        finished = await self.ctx.bus.last_stored(
            line.subjects.stream_metrics(), line.subjects.train_finished()
        )
        return finished is not None

    def _train_finished_handler(
        self, line: PolicyLine
    ) -> Callable[[TrainingFinished], Awaitable[None]]:
        async def on_train_finished(_: TrainingFinished) -> None:
            line.finished = True
            log.info("the trainer of %s finished: it no longer sets the pace", line.policy)

        return on_train_finished

    async def _last_plan(self, line: PolicyLine) -> TrainingPlanned | None:
        msg = await self.ctx.bus.last_stored(
            line.subjects.stream_metrics(), line.subjects.train_plan()
        )
        if msg is None:
            return None
        plan: TrainingPlanned = decode(msg.data, TrainingPlanned)
        return plan

    def _check_plan(self, plan: TrainingPlanned) -> None:
        """One seed for the run: the task order here, the trainer's evaluation split."""
        if plan.seed != self.ctx.mesh.seed:
            raise Unrecoverable(
                f"the trainer of {plan.policy} runs with SF_SEED={plan.seed} but this "
                f"trajectory service has SF_SEED={self.ctx.mesh.seed}: start every service "
                "of a run with the same SF_SEED"
            )

    def _step_budget(self) -> int:
        """Batches to dispatch for: the largest budget the trainers announced (tasks are
        shared by the policies), once every policy's trainer announced one; 0 until then
        (the pacing alone bounds the dispatch)."""
        planned = [line.planned_steps for line in self.lines.values()]
        if any(steps is None for steps in planned):
            return 0
        return max(steps for steps in planned if steps is not None)

    def _train_plan_handler(self, line: PolicyLine) -> Callable[[TrainingPlanned], Awaitable[None]]:
        async def on_train_plan(plan: TrainingPlanned) -> None:
            try:
                self._check_plan(plan)
            except Unrecoverable as exc:
                self._plan_error = exc
                self._plan_failed.set()
                return
            line.planned_steps = plan.steps
            self.dispatcher.set_total_batches(self._step_budget())
            log.info("the trainer of %s plans %d steps", line.policy, plan.steps)

        return on_train_plan

    async def _plan_watch(self) -> None:
        """A trainer announced another seed after start: end the run with that line."""
        await self._plan_failed.wait()
        assert self._plan_error is not None
        raise self._plan_error

    def _train_metrics_handler(
        self, line: PolicyLine
    ) -> Callable[[TrainStepMetrics], Awaitable[None]]:
        async def on_train_metrics(metrics: TrainStepMetrics) -> None:
            line.trained_batches = max(line.trained_batches, metrics.batch_index + 1)
            line.published_version = max(line.published_version, metrics.version)

        return on_train_metrics


class TrustedRewards:
    """The reward functions sessions may name: the registered ones, the stages' and
    ``SF_TRAJECTORY_REWARD_FNS``. A session's ``reward_fn`` is chosen by whoever opened
    it; importing and calling any dotted path it names would run code of their choice
    here (``os:system``...)."""

    def __init__(self, trusted: set[str]) -> None:
        self.trusted = trusted

    def __call__(self, name: str) -> RewardFn:
        if name not in self.trusted and name not in reward_names():
            raise KeyError(
                f"reward function {name!r} is not registered, not a stage's and not in "
                f"SF_TRAJECTORY_REWARD_FNS"
            )
        return get_reward(name)


def _prefixed(prefix: str, counts: dict[str, int]) -> dict[str, int]:
    """Span attributes ``<prefix>.<reason>`` for a count by reason."""
    return {f"{prefix}.{reason}": count for reason, count in counts.items()}
