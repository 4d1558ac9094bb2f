"""trajectory: the trajectory manager and the rollout rhythm.

Over 400 lines with this docstring's subject list; the code is the composition of its
parts (replay, event order, batch publisher, trainer follower) and about 370 lines.

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
  a group handed out made no progress for ``SF_GROUP_TIMEOUT_S``, see
  ``timeouts``; message id ``closed-<group>``)

Data algorithms (``data_filters``) and the stage schedule (``schedule``) are configured
by ``SF_TRAJECTORY_DATA_FILTERS`` and ``SF_TRAJECTORY_STAGES``.

The parts: ``replay`` (the state rebuilt at start-up from what the streams hold; pure),
``event_order`` (events applied in stream order per session, finishes verified in worker
threads), ``grouping`` (sessions -> samples -> groups -> batches; pure),
``batch_publisher`` (batches, their reports and progress going out),
``trainer_follower`` (each trainer's progress, step budget and seed), ``dispatch`` (the
rollout rhythm), ``timeouts`` (groups that stopped making progress), ``group_ids``,
``trusted_rewards``; this module wires them: it restores, follows the stream, answers
claims and exports, and closes groups that time out.

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
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from seamlessflow import telemetry
from seamlessflow.batches import stored_announcements
from seamlessflow.bus import Msg, NotFound, Subscription, Unrecoverable
from seamlessflow.protocol import (
    BatchFilterReport,
    EpochFilterReport,
    GroupClosed,
    MessageIds,
    NoTask,
    SessionExport,
    SessionExportQuery,
    SessionFinished,
    SessionOpened,
    TaskAssignment,
    TaskClaim,
    TrainingPlanned,
    TrainStepMetrics,
    TrajectoryEvent,
    decode,
)
from seamlessflow.service import ServiceContext, supervise
from sf_trajectory.batch_publisher import BatchPublisher, prefixed
from sf_trajectory.data_filters import DataFilters
from sf_trajectory.dispatch import Dispatcher
from sf_trajectory.event_order import EventOrder
from sf_trajectory.grouping import Grouper, export_session
from sf_trajectory.policy_line import PolicyLine
from sf_trajectory.replay import GroupReplay, StoredLine, restore_line
from sf_trajectory.schedule import build_stages
from sf_trajectory.settings import TrajectorySettings
from sf_trajectory.timeouts import GroupTimeouts
from sf_trajectory.trainer_follower import TrainerFollower
from sf_trajectory.trusted_rewards import TrustedRewards

log = logging.getLogger(__name__)

ANSWERED_CLAIMS_KEPT = 4096
"""Assignments remembered for repeated claims (``TaskClaim.claim_id``)."""
tracer = telemetry.tracer(__name__)


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
        self._event_order = EventOrder(
            self._apply_verified, self._verifications, self.settings.verify_concurrency
        )
        """Events applied in stream order per session, finishes verified in threads."""
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
        trusted = {fn for stage in self.stages for fn in stage.reward_fns()}
        trusted |= {*self.settings.trusted_reward_fns()}
        self.reward_lookup = TrustedRewards(trusted)
        self.trainers = TrainerFollower(self.lines, ctx.mesh.seed)
        self.batches = BatchPublisher(ctx.bus, self.stages, self.settings.groups_per_batch)
        for policy in ctx.mesh.policy_names():
            self.lines[policy] = await self._restored_line(policy)
        events, last_seq = await ctx.bus.follow(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
        next_group, next_sample = await self._replay_events(events, last_seq)
        self.dispatcher = Dispatcher(
            self.stages,
            group_size=self.settings.group_size,
            groups_per_batch=self.settings.groups_per_batch,
            total_batches=self.trainers.step_budget(),
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
        self.trainers.on_budget = self.dispatcher.set_total_batches
        await self.trainers.subscribe(ctx.bus)
        await ctx.bus.serve(subjects.task_claim(), TaskClaim, self.on_claim)
        await ctx.bus.serve(subjects.trajectory_export(), SessionExportQuery, self.on_export)
        self.ready.set()
        try:
            await supervise(
                ctx.stopping, self._event_loop(events), self._timeout_loop(), self.trainers.watch()
            )
        finally:
            self._event_order.shutdown()

    async def _restored_line(self, policy: str) -> PolicyLine:
        """The policy's line as its streams left it (``replay.restore_line``)."""
        filters = DataFilters.from_settings(
            self.settings.data_filter_names(), self.settings.data_filter
        )
        grouper = Grouper(self.reward_lookup, filters=filters, policy=policy)
        line = PolicyLine(self.ctx.subjects.for_policy(policy), grouper)
        stored = await self._read_stored(line)
        if stored.plan is not None:
            self.trainers.check_plan(stored.plan)
        restore_line(line, stored)
        return line

    async def _read_stored(self, line: PolicyLine) -> StoredLine:
        """What the streams hold for the policy: its batches, its batch reports and its
        trainer's metrics, finish and plan."""
        bus, subjects = self.ctx.bus, line.subjects
        metrics_stream = subjects.stream_metrics()
        return StoredLine(
            announcements=await stored_announcements(bus, line.policy),
            batch_reports=await bus.read_decoded(
                metrics_stream, subjects.data_batch_report(), BatchFilterReport
            ),
            train_metrics=await bus.read_decoded(
                metrics_stream, subjects.train_metrics(), TrainStepMetrics
            ),
            trainer_finished=await bus.last_stored(metrics_stream, subjects.train_finished())
            is not None,
            plan=await self._last_plan(line),
        )

    async def _replay_events(self, events: Subscription, last_seq: int) -> tuple[int, int]:
        """Apply every event the trajectory stream holds (up to ``last_seq``) again, the
        way live ones are; return the (group, sample) dispatch resumes from. Groups
        handed out that never opened a session start waiting for their time-out."""
        replay = GroupReplay()
        async with self._event_order.applying():  # on leaving, every replayed event is applied
            while last_seq:
                msg = await events.next_msg(timeout=10.0)
                event = self._decode_event(msg)
                replay.read(event)
                if event is not None:
                    await self._event_order.apply(event)
                if msg.metadata.sequence.stream >= last_seq:
                    break
        lines = self.lines.values()
        resume_point = replay.resume_point(
            finished_groups=[g for line in lines for g in line.grouper.finished_groups],
            open_groups={g for line in lines for g in line.grouper.groups},
            group_size=self.settings.group_size,
        )
        for group in replay.unopened_groups():
            self.timeouts.progress(group, "", self.settings.group_size, time.monotonic())
        for line in lines:
            log.info(
                "%s: replayed %d events; %d sessions open, %d batches published, %d trained",
                line.policy, replay.events, len(line.grouper.sessions), line.next_batch_index,
                line.trained_batches,
            )  # fmt: skip
        return resume_point

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
                    **prefixed("epoch.kept", report.kept),
                    **prefixed("epoch.dropped", report.dropped),
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
        async with self._event_order.applying():
            while True:
                # No time-out: on Python 3.11, a cancellation that lands as next_msg's
                # time-out fires comes out of asyncio.wait_for as a TimeoutError, and a
                # loop that goes on after time-outs would never stop.
                msg = await events.next_msg(timeout=None)
                event = self._decode_event(msg)
                if event is not None:
                    await self._event_order.apply(event)

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
                f"{timed_out} group(s) timed out (SF_GROUP_TIMEOUT_S="
                f"{self.timeouts.timeout_s:.0f}); check that agents reach the gateway and "
                "engines answer (their logs)"
            )

    def _verifications(self, event: TrajectoryEvent) -> list[Callable[[], None]]:
        """What scores ``event`` before it is applied (the lines' task verifiers)."""
        calls = (line.grouper.pending_verification(event) for line in self.lines.values())
        return [call for call in calls if call is not None]

    async def _apply_verified(self, event: TrajectoryEvent) -> None:
        opened = self._opened_of(event)
        for line in self.lines.values():
            await self._apply_to(line, event)
        if isinstance(event, SessionFinished):
            self._last_finished = time.monotonic()
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
        line.grouper.apply(event)
        await self.batches.publish_ready(line)

    async def _load_epoch_reports(self) -> list[EpochFilterReport]:
        subjects = self.ctx.subjects
        return await self.ctx.bus.read_decoded(
            subjects.stream_metrics(), subjects.data_epoch_report(), EpochFilterReport
        )

    async def _last_plan(self, line: PolicyLine) -> TrainingPlanned | None:
        msg = await self.ctx.bus.last_stored(
            line.subjects.stream_metrics(), line.subjects.train_plan()
        )
        if msg is None:
            return None
        plan: TrainingPlanned = decode(msg.data, TrainingPlanned)
        return plan
