"""trajectory: the trajectory manager and the rollout rhythm.

Consumes:
- ``sf.<run>.traj.export`` (request SessionExportQuery -> reply SessionExport: every
  branch of one session, rebuilt from its stored events)
- ``sf.<run>.traj.event.<session>`` (JetStream ``SF_<RUN>_TRAJ``: SessionOpened,
  TurnRecorded, RewardReported, SessionFinished from the gateway), replayed from the
  stream's start on every start-up, so a restart rebuilds exactly the open sessions
- ``sf.<run>.task.claim`` (request TaskClaim -> reply TaskAssignment | NoTask)
- ``sf.<run>.train.metrics`` (TrainStepMetrics: how far the trainer has consumed)
Produces:
- ``sf.<run>.batch.ready`` (JetStream ``SF_<RUN>_BATCH``: TrainBatch, message id
  ``batch-<index>`` so a re-publish after a restart lands once)

Durability (invariant 4): a session that is in a published batch is never batched
again (the batch stream is read at start-up); a completed session that is not yet in
a batch is rebuilt from the event stream.
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
import nats.js.errors

from seamlessflow import telemetry
from seamlessflow.bus import NotFound
from seamlessflow.protocol import (
    NoTask,
    SessionExport,
    SessionExportQuery,
    SessionOpened,
    TaskAssignment,
    TaskClaim,
    TrainBatch,
    TrainStepMetrics,
    TrajectoryEvent,
    decode,
)
from seamlessflow.rewards import get_reward
from seamlessflow.service import ServiceContext, supervise
from seamlessflow.tasks import get_task_source
from sf_trajectory.config import TrajectorySettings
from sf_trajectory.dispatch import Dispatcher, group_index
from sf_trajectory.grouping import Grouper, export_session

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class TrajectoryService:
    name = "trajectory"

    def __init__(self, settings: TrajectorySettings | None = None) -> None:
        self.settings = settings or TrajectorySettings()
        self.trained_batches = 0
        self.next_batch_index = 0
        self.malformed_events = 0
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        subjects = ctx.subjects
        batched_sessions = await self._load_batched_sessions()
        self.trained_batches = await self._load_trained_batches()
        self.grouper = Grouper(get_reward, batched_sessions)

        events, last_seq = await ctx.bus.follow(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
        max_group = -1
        replayed = 0
        while last_seq:
            msg = await events.next_msg(timeout=10.0)
            replayed += 1
            event = self._decode_event(msg)
            if event is not None:
                if isinstance(event, SessionOpened):
                    max_group = max(max_group, group_index(event.group_id))
                await self._apply(event)
            if msg.metadata.sequence.stream >= last_seq:
                break
        log.info(
            "replayed %d events; %d sessions open, %d batches published, %d trained",
            replayed, len(self.grouper.sessions), self.next_batch_index, self.trained_batches,
        )  # fmt: skip

        source = get_task_source(self.settings.task, seed=self.settings.seed)
        self.dispatcher = Dispatcher(
            source.items("train"),
            reward_fn=source.reward_fn,
            group_size=self.settings.group_size,
            groups_per_batch=self.settings.groups_per_batch,
            total_batches=self.settings.total_batches,
            max_batches_ahead=self.settings.max_batches_ahead,
            seed=self.settings.seed,
            next_group=max_group + 1,
        )
        await ctx.bus.nc.subscribe(subjects.train_metrics(), cb=self._on_train_metrics)
        await ctx.bus.serve(subjects.task_claim(), TaskClaim, self.on_claim)
        await ctx.bus.serve(subjects.trajectory_export(), SessionExportQuery, self.on_export)
        self.ready.set()
        await supervise(ctx.stopping, self._event_loop(events))

    async def on_claim(self, claim: TaskClaim) -> TaskAssignment | NoTask:
        return self.dispatcher.claim(self.trained_batches, self.grouper.groups_lost)

    async def on_export(self, query: SessionExportQuery) -> SessionExport:
        subjects = self.ctx.subjects
        messages = await self.ctx.bus.read_subject(
            subjects.stream_trajectory(), subjects.trajectory_event(query.session_id)
        )
        events = [e for e in (self._decode_event(m) for m in messages) if e is not None]
        if not events:
            raise NotFound(f"session {query.session_id!r} does not exist")
        return export_session(events, get_reward)

    async def _event_loop(self, events) -> None:  # type: ignore[no-untyped-def]
        while True:
            try:
                msg = await events.next_msg(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            event = self._decode_event(msg)
            if event is not None:
                await self._apply(event)

    def _decode_event(self, msg) -> TrajectoryEvent | None:  # type: ignore[no-untyped-def]
        try:
            return decode(msg.data, TrajectoryEvent)  # type: ignore[no-any-return]
        except ValueError as exc:
            # Nobody awaits a reply on a stream; count it and move on (it changes nothing).
            self.malformed_events += 1
            log.warning("ignoring malformed trajectory event on %s: %s", msg.subject, exc)
            return None

    async def _apply(self, event: TrajectoryEvent) -> None:
        self.grouper.apply(event)
        while (
            groups := self.grouper.take_batch(
                self.settings.groups_per_batch,
                batch_index=self.next_batch_index,
                max_staleness=self.settings.max_staleness,
            )
        ) is not None:
            batch = TrainBatch(batch_index=self.next_batch_index, groups=groups)
            with tracer.start_as_current_span(
                "trajectory.batch", attributes={"batch.index": batch.batch_index}
            ):
                await self.ctx.bus.js_publish(
                    self.ctx.subjects.batch_ready(), batch, msg_id=f"batch-{batch.batch_index}"
                )
            for group in groups:
                self.grouper.already_batched.update(s.session_id for s in group.samples)
            self.next_batch_index += 1

    async def _load_batched_sessions(self) -> set[str]:
        subjects = self.ctx.subjects
        batched: set[str] = set()
        for msg in await self.ctx.bus.read_all(subjects.stream_batches(), subjects.batch_ready()):
            batch = decode(msg.data, TrainBatch)
            batched.update(s.session_id for g in batch.groups for s in g.samples)
            self.next_batch_index = max(self.next_batch_index, batch.batch_index + 1)
        return batched

    async def _load_trained_batches(self) -> int:
        subjects = self.ctx.subjects
        try:
            msg = await self.ctx.bus.js.get_last_msg(
                subjects.stream_metrics(), subjects.train_metrics()
            )
        except nats.js.errors.NotFoundError:
            return 0
        assert msg.data is not None
        return int(decode(msg.data, TrainStepMetrics).batch_index) + 1

    async def _on_train_metrics(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            metrics = decode(msg.data, TrainStepMetrics)
        except ValueError:
            return
        self.trained_batches = max(self.trained_batches, metrics.batch_index + 1)
