"""tag-scheduler: resources, tags, roles, phases, liveness, and lending training slots.

Consumes:
- ``sf.<run>.sched.register`` (request ResourceRegister -> reply RoleAssignment)
- ``sf.<run>.sched.heartbeat.<resource>`` (Heartbeat, core)
- ``sf.<run>.sched.claim`` (request SlotsClaim -> SlotsGranted): the trainer has a
  batch; every engine lent from its slots is reclaimed before the reply
- ``sf.<run>.sched.release`` (request SlotsReleased -> LendReport): the trainer waits;
  the policy decides which engines on its slots to lend
- ``sf.<run>.batch.<policy>.progress`` (BatchProgress, core, from the trajectory
  service): with ``SF_TAG_SCHEDULER_RECLAIM_EARLY_AT`` < 1, once that share of the next
  batch's groups is ready the lent engines are taken back while the trainer still
  waits (the early reclaim); the claim then waits for that reclaim to end
Produces:
- ``sf.<run>.sched.assign.<resource>`` (request RoleAssignment -> RoleAck): role
  changes (lend: ``rollout``; reclaim: ``idle``), acked once in effect
- ``sf.<run>.engine.shed.<engine>`` (request ShedRequests -> ShedReport): rebalance
  on lend, once lent engines serve (``TagPolicy.shed_plan`` over the loads the
  engines' heartbeats report)
- ``sf.<run>.sched.cores.<trainer>`` (CoresLent, core): with
  ``SF_TAG_SCHEDULER_LEND_CORES_TO_TRAINING``, while a trainer trains (claim to
  release), the cores of the dedicated rollout engines on its host that have nothing
  to do (``policy.cores_for_training``); sent on every change, 0 threads when the
  engines take them back or the trainer stops training
- ``sf.<run>.sched.phase`` (PhaseChanged: phase transitions and deaths)
- KV bucket ``sf_<run>_resources``: one entry per resource (tags, slots, role, phase,
  status, process); read back on start-up, so a restarted scheduler knows every
  resource again without asking it to register (see ``_restore``)
- spans ``sched.decide`` (each lending decision and its estimates), ``sched.lend`` and
  ``sched.reclaim`` (the switches and their cost; ``early`` for an early reclaim),
  ``sched.rebalance`` (requests moved onto lent engines)

The decisions themselves are made by :class:`sf_tag_scheduler.policy.TagPolicy`, the
same object the simulator drives; this module only does the I/O around it.

Multi-policy: every resource names its policy with a ``policy:<name>`` tag (default
``policy``), and each policy's trainer claims and releases for that policy. The
scheduler keeps one ``TagPolicy`` per policy: an engine is lent only while the trainer
of its own policy waits, and reclaimed when that trainer claims. (Lending a slot to
another policy's rollout would need the engine to swap models; not done.)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, replace

import orjson

from seamlessflow import telemetry
from seamlessflow.bus import NoResponder, RemoteError
from seamlessflow.protocol import (
    DEFAULT_POLICY,
    BatchProgress,
    CoresLent,
    Heartbeat,
    LendReport,
    PhaseChanged,
    ResourceRegister,
    Role,
    RoleAck,
    RoleAssignment,
    ShedReport,
    ShedRequests,
    SlotsClaim,
    SlotsGranted,
    SlotsReleased,
    check_policy,
    check_token,
    policy_of_tags,
)
from seamlessflow.service import ServiceContext, supervise
from sf_tag_scheduler.policy import (
    EngineLoad,
    LendPlan,
    ResourceView,
    TagPolicy,
    cores_for_training,
    lent_threads,
)
from sf_tag_scheduler.settings import TagSchedulerSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


@dataclass
class ResourceState:
    view: ResourceView
    policy: str
    role: str
    phase: str = "idle"
    last_seen: float = 0.0
    alive: bool = True
    process: tuple[str, int] = ("", 0)
    """Host and pid of the process that registered it."""
    in_flight: int = 0
    """Requests in flight, as its last heartbeat said."""


class TagSchedulerService:
    name = "tag-scheduler"

    def __init__(self, settings: TagSchedulerSettings | None = None) -> None:
        self.settings = settings or TagSchedulerSettings()
        self.policies: dict[str, TagPolicy] = {}
        """Policy name -> the decisions for its resources and its trainer."""
        self.resources: dict[str, ResourceState] = {}
        self.ready = asyncio.Event()
        self._lends: asyncio.Queue[tuple[str, LendPlan]] = asyncio.Queue()
        self._reassign: asyncio.Queue[str] = asyncio.Queue()
        self._early_reclaims: dict[str, asyncio.Task[None]] = {}
        """Per policy, the early reclaim under way (the claim waits for it)."""
        self.trainer_versions: dict[str, int] = {}
        """Per policy, the newest version its trainer released its slots with: engines
        lent to it serve no older weights."""
        self.training: dict[str, str] = {}
        """Per policy, the trainer that claimed its slots and has not released them."""
        self.cores_lent: dict[str, tuple[str, ...]] = {}
        """Per policy, the engines whose cores its trainer was last told it may use."""

    def decisions(self, policy: str = DEFAULT_POLICY) -> TagPolicy:
        """The scheduling policy object of one (RL) policy, made on first use."""
        decisions = self.policies.get(policy)
        if decisions is None:
            decisions = self.policies[policy] = TagPolicy(self.settings.policy_config())
        return decisions

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.kv = await ctx.bus.key_value(ctx.subjects.kv_resources())
        await self._restore()
        await ctx.bus.serve(ctx.subjects.sched_register(), ResourceRegister, self.on_register)
        await ctx.bus.serve(ctx.subjects.sched_claim(), SlotsClaim, self.on_claim)
        await ctx.bus.serve(ctx.subjects.sched_release(), SlotsReleased, self.on_release)
        await ctx.bus.subscribe(ctx.subjects.sched_heartbeat_all(), Heartbeat, self.on_heartbeat)
        if self.settings.reclaim_early_at < 1:
            await ctx.bus.subscribe(
                ctx.subjects.batch_progress_all(), BatchProgress, self.on_progress
            )
        log.info("tag-scheduler up (mode=%s)", self.settings.mode)
        self.ready.set()
        await supervise(
            ctx.stopping, self._liveness_loop(), self._lend_loop(), self._reassign_loop()
        )

    # ------------------------------------------------------------------ registration

    async def on_register(self, request: ResourceRegister) -> RoleAssignment:
        check_token(request.resource_id, "resource id")
        for slot in request.slots:
            check_token(slot, "slot")
        policy = policy_of_tags(request.tags)
        view = ResourceView(
            request.resource_id,
            request.kind,
            frozenset(request.tags),
            tuple(request.slots) or (request.resource_id,),
        )
        previous = self.resources.get(request.resource_id)
        if previous is not None and previous.policy != policy:
            self.decisions(previous.policy).forget(request.resource_id)
        if (
            previous is not None
            and previous.alive
            and previous.process != (request.host, request.pid)
        ):
            # A restarted process under the same id (an engine killed and started again
            # faster than ``dead_after_s``): the old one is dead, and the requests it held
            # must be re-routed now. The new one takes none before its registration ends.
            log.warning("%s registered again by a new process: the previous one is dead",
                        request.resource_id)  # fmt: skip
            await self.ctx.bus.publish(
                self.ctx.subjects.sched_phase(),
                PhaseChanged(resource_id=request.resource_id, phase="dead"),
            )
        decisions = self.decisions(policy)
        decisions.add(view)
        # A lendable engine joining while its trainer waits may be lent at once.
        self._lend_others(policy, decisions.rebalance(time.monotonic()), request.resource_id)
        decision = decisions.role_of(request.resource_id)
        self.resources[request.resource_id] = ResourceState(
            view=view,
            policy=policy,
            role=decision.role,
            last_seen=time.time(),
            process=(request.host, request.pid),
        )
        await self._store(request.resource_id)
        log.info(
            "registered %s %s tags=%s slots=%s -> %s",
            request.kind,
            request.resource_id,
            sorted(request.tags),
            list(view.slots),
            decision.role,
        )
        return self._assignment(request.resource_id, decision.role, decision.reason)

    async def _restore(self) -> None:
        """After a restart: every resource recorded in the KV bucket, as if it had just
        registered. Its heartbeats keep it alive (or it is declared dead after
        ``dead_after_s``); one whose recorded role differs from what the policy says now
        (an engine lent before the restart) is told its role. Lending decisions and
        their measurements start afresh."""
        for key in await self.kv.keys():
            value = await self.kv.get(key)
            if value is None:
                continue
            record = orjson.loads(value)
            view = ResourceView(
                record["resource_id"],
                record["kind"],
                frozenset(record["tags"]),
                tuple(record["slots"]),
            )
            decisions = self.decisions(record["policy"])
            decision = decisions.add(view)
            state = ResourceState(
                view=view,
                policy=record["policy"],
                role=record["role"],
                phase=record["phase"],
                last_seen=time.time(),
                alive=record["alive"],
                process=(record.get("host", ""), record.get("pid", 0)),
            )
            self.resources[view.resource_id] = state
            if not state.alive:
                decisions.remove(view.resource_id)
            elif decision.role != state.role:
                self._reassign.put_nowait(view.resource_id)
        if self.resources:
            log.info("restored %d resources from the KV bucket", len(self.resources))

    # ------------------------------------------------------------------ the trainer's demand

    async def on_claim(self, claim: SlotsClaim) -> SlotsGranted:
        """Reclaim every lent engine; reply once each released its slot (or timed out),
        an early reclaim still under way included."""
        started = time.monotonic()
        check_policy(claim.policy)
        decisions = self.decisions(claim.policy)
        plan = decisions.trainer_claims(started)
        early = self._early_reclaims.pop(claim.policy, None)
        if early is not None:
            await early  # the slots are the trainer's only once that reclaim is over
        missed = await self._reclaim(
            claim.policy, plan.reclaim, plan.reason, batch_index=claim.batch_index, early=False
        )
        self.training[claim.policy] = claim.trainer_id
        await self._lend_cores(claim.policy)
        seconds = time.monotonic() - started
        return SlotsGranted(reclaimed=list(plan.reclaim), seconds=seconds, missed=missed)

    async def _reclaim(
        self, policy: str, engines: tuple[str, ...], reason: str, *, batch_index: int, early: bool
    ) -> list[str]:
        """Take ``engines`` back (role ``idle``); the ones that did not ack in time."""
        started = time.monotonic()
        with tracer.start_as_current_span(
            "sched.reclaim",
            attributes={
                "policy": policy,
                "batch.index": batch_index,
                "reclaimed": list(engines),
                "early": early,
            },
        ) as span:
            acks = await self._assign_all(engines, "idle", reason, self.settings.reclaim_timeout_s)
            seconds = time.monotonic() - started
            missed = [rid for rid, ack in zip(engines, acks, strict=True) if ack is None]
            span.set_attribute("seconds", seconds)
            span.set_attribute("handed_back", sum(a.handed_back for a in acks if a))
            span.set_attribute("lent_busy_s", sum(a.busy_s for a in acks if a))
            span.set_attribute("missed", missed)
        if engines:
            self.decisions(policy).observe_reclaim(seconds)
            log.info("reclaimed %s%s in %.3fs (missed %s)",
                     list(engines), " early" if early else "", seconds, missed)  # fmt: skip
        return missed

    async def on_progress(self, progress: BatchProgress) -> None:
        """A group of the next batch is ready: once ``reclaim_early_at`` of them are,
        take the policy's lent engines back while its trainer still waits. (A policy
        with no decisions here, a malformed name included, has nothing lent; an early
        reclaim under way has already emptied ``lent``.)"""
        decisions = self.policies.get(progress.policy)
        needed = math.ceil(self.settings.reclaim_early_at * progress.groups_per_batch)
        if (
            decisions is None
            or not decisions.lent
            or decisions.trainer.waiting_since is None
            or progress.groups_ready < needed
        ):
            return
        plan = decisions.trainer_prepares(time.monotonic())
        if plan.reclaim:
            self._early_reclaims[progress.policy] = asyncio.create_task(
                self._reclaim_early(progress, plan.reclaim, plan.reason)
            )

    async def _reclaim_early(
        self, progress: BatchProgress, engines: tuple[str, ...], reason: str
    ) -> None:
        try:
            await self._reclaim(
                progress.policy, engines, reason, batch_index=progress.batch_index, early=True
            )
        finally:
            # over: the claim has nothing to wait for, and the next wait may reclaim early
            if self._early_reclaims.get(progress.policy) is asyncio.current_task():
                del self._early_reclaims[progress.policy]

    async def on_release(self, release: SlotsReleased) -> LendReport:
        """The trainer waits: decide now, lend in the background (the trainer goes on)."""
        check_policy(release.policy)
        await self._lend_cores(release.policy, released=True)
        self.trainer_versions[release.policy] = max(
            self.trainer_versions.get(release.policy, 0), release.version
        )
        decisions = self.decisions(release.policy)
        plan = decisions.trainer_waiting(time.monotonic())
        with tracer.start_as_current_span(
            "sched.decide",
            attributes={
                "trainer.id": release.trainer_id,
                "policy": release.policy,
                "version": release.version,
                "lent": list(plan.lend),
                "reason": plan.reason,
                "expected_wait_s": _span_seconds(plan.expected_wait_s),
                "gain_s": _span_seconds(plan.gain_s),
                "cost_s": plan.cost_s,
                "lend_in_s": decisions.lend_cost.value or 0.0,
            },
        ):
            if plan.lend:
                self._lends.put_nowait((release.policy, plan))
        log.info(
            "trainer of %s waits (v%d): lend %s: %s",
            release.policy, release.version, list(plan.lend), plan.reason,
        )  # fmt: skip
        return LendReport(
            lent=list(plan.lend),
            reason=plan.reason,
            expected_wait_s=_finite(plan.expected_wait_s),
            gain_s=_finite(plan.gain_s),
            cost_s=plan.cost_s,
        )

    async def _lend_loop(self) -> None:
        while True:
            policy, plan = await self._lends.get()
            started = time.monotonic()
            with tracer.start_as_current_span(
                "sched.lend",
                attributes={
                    "policy": policy,
                    "lent": list(plan.lend),
                    "reason": plan.reason,
                    "expected_wait_s": _span_seconds(plan.expected_wait_s),
                    "cost_s": plan.cost_s,
                },
            ) as span:
                acks = await self._assign_all(
                    plan.lend, "rollout", plan.reason, self.settings.lend_timeout_s
                )
                span.set_attribute("seconds", time.monotonic() - started)
            for ack in acks:
                if ack is not None:
                    self.decisions(policy).observe_lend(ack.seconds)
            serving = tuple(rid for rid, ack in zip(plan.lend, acks, strict=True) if ack)
            if serving and self.settings.rebalance_on_lend:
                await self._rebalance_onto(policy, serving)

    async def _rebalance_onto(self, policy: str, targets: tuple[str, ...]) -> None:
        """Freshly lent engines serve: move in-flight requests onto them from the
        busiest engines of the policy (the engines hand them over, the gateway resumes
        them there). Loads are the heartbeats' (up to one interval old); a donor hands
        over at most what it still has."""
        decisions = self.decisions(policy)
        loads = {
            rid: state.in_flight
            for rid, state in self.resources.items()
            if state.policy == policy
            and state.alive
            and state.view.kind == "engine"
            and state.role == "rollout"
        }
        for rid in targets:
            loads.setdefault(rid, 0)
        plan = decisions.shed_plan(loads, targets)
        with tracer.start_as_current_span(
            "sched.rebalance",
            attributes={"policy": policy, "targets": list(targets), "planned": len(plan)},
        ) as span:
            reports = await asyncio.gather(
                *(self._shed(move.donor, move.target, move.count) for move in plan)
            )
            moved = sum(report.handed_over for report in reports if report is not None)
            span.set_attribute("handed_over", moved)
        if plan:
            log.info("rebalanced %d requests onto %s", moved, list(targets))

    async def _shed(self, donor: str, target: str, count: int) -> ShedReport | None:
        try:
            report: ShedReport = await self.ctx.bus.request(
                self.ctx.subjects.engine_shed(donor),
                ShedRequests(to_engine=target, count=count),
                ShedReport,
                timeout=self.settings.reclaim_timeout_s,
            )
        except (NoResponder, RemoteError) as exc:
            log.warning("%s did not hand requests over: %s", donor, exc)
            return None
        return report

    async def _reassign_loop(self) -> None:
        """A resource back from the dead is told the role it should play now (it may
        still believe in a lend that was cancelled when it was declared dead)."""
        while True:
            resource_id = await self._reassign.get()
            decisions = self.decisions(self.resources[resource_id].policy)
            if resource_id in decisions.members:
                decision = decisions.role_of(resource_id)
                await self._assign(
                    resource_id, decision.role, decision.reason, self.settings.reclaim_timeout_s
                )

    def _assignment(self, resource_id: str, role: Role, reason: str) -> RoleAssignment:
        # a lent engine serves no older weights than its trainer just published
        state = self.resources.get(resource_id)
        policy = state.policy if state is not None else DEFAULT_POLICY
        min_version = self.trainer_versions.get(policy, 0) if role == "rollout" else 0
        return RoleAssignment(
            resource_id=resource_id, role=role, reason=reason, min_version=min_version
        )

    async def _assign_all(
        self, resource_ids: tuple[str, ...], role: Role, reason: str, timeout: float
    ) -> list[RoleAck | None]:
        return await asyncio.gather(
            *(self._assign(rid, role, reason, timeout) for rid in resource_ids)
        )

    async def _assign(
        self, resource_id: str, role: Role, reason: str, timeout: float
    ) -> RoleAck | None:
        """Ask a resource to take ``role``; None if it did not ack in time (or refused)."""
        state = self.resources.get(resource_id)
        if state is not None:
            state.role = role
        try:
            ack: RoleAck = await self.ctx.bus.request(
                self.ctx.subjects.sched_assignment(resource_id),
                self._assignment(resource_id, role, reason),
                RoleAck,
                timeout=timeout,
            )
        except (NoResponder, RemoteError) as exc:
            log.warning("%s did not take role %s: %s", resource_id, role, exc)
            return None
        if state is not None:
            await self._store(resource_id)
        return ack

    # ------------------------------------------------------------------ liveness

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        state = self.resources.get(beat.resource_id)
        if state is None:
            return  # not registered (yet); its register request will follow
        if beat.leaving:
            if state.alive:
                log.info("resource %s left", beat.resource_id)
                await self._retire(beat.resource_id, state)
            return
        state.last_seen = time.time()
        load_changed = (beat.in_flight, beat.phase) != (state.in_flight, state.phase)
        state.in_flight = beat.in_flight
        revived = not state.alive
        state.alive = True
        if revived:
            self.decisions(state.policy).revive(beat.resource_id)
            self._reassign.put_nowait(beat.resource_id)
        if beat.phase != state.phase or revived:
            state.phase = beat.phase
            await self.ctx.bus.publish(
                self.ctx.subjects.sched_phase(),
                PhaseChanged(resource_id=beat.resource_id, phase=beat.phase),
            )
            await self._store(beat.resource_id)
        if (load_changed or revived) and state.view.kind == "engine":
            await self._lend_cores(state.policy)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_s)
            now = time.time()
            for resource_id, state in list(self.resources.items()):
                if state.alive and now - state.last_seen > self.settings.dead_after_s:
                    log.warning("resource %s missed heartbeats: declared dead", resource_id)
                    await self._retire(resource_id, state)

    async def _retire(self, resource_id: str, state: ResourceState) -> None:
        """``resource_id`` is gone (it left, or missed its heartbeats): out of the
        decisions, announced as dead (the gateway re-routes what it held), stored."""
        state.alive = False
        decisions = self.decisions(state.policy)
        decisions.remove(resource_id)
        await self.ctx.bus.publish(
            self.ctx.subjects.sched_phase(),
            PhaseChanged(resource_id=resource_id, phase="dead"),
        )
        await self._store(resource_id)
        self._lend_others(state.policy, decisions.rebalance(time.monotonic()), resource_id)
        await self._lend_cores(state.policy)

    # ------------------------------------------------------------------ cores to training

    async def _lend_cores(self, policy: str, released: bool = False) -> None:
        """Tell the training trainer of ``policy`` which idle engines' cores it may use,
        if that changed. ``released``: it stops training (0 threads from now)."""
        trainer_id = self.training.pop(policy, None) if released else self.training.get(policy)
        if trainer_id is None or not self.settings.lend_cores_to_training:
            return
        engines = self._engine_loads(policy)
        lent: tuple[str, ...] = ()
        if not released:
            trainer = self.resources.get(trainer_id)
            lent = cores_for_training(trainer.process[0] if trainer else "", engines)
        if lent == self.cores_lent.get(policy, ()):
            return
        self.cores_lent[policy] = lent
        threads = lent_threads(engines, lent)
        with tracer.start_as_current_span(
            "sched.cores",
            attributes={
                "policy": policy,
                "trainer.id": trainer_id,
                "engines": list(lent),
                "threads": threads,
            },
        ):
            await self.ctx.bus.publish(
                self.ctx.subjects.sched_cores(trainer_id),
                CoresLent(
                    trainer_id=trainer_id, threads=threads, engines=list(lent), policy=policy
                ),
            )

    def _engine_loads(self, policy: str) -> list[EngineLoad]:
        return [
            EngineLoad(state.view, state.process[0], state.phase, state.in_flight, state.alive)
            for state in self.resources.values()
            if state.policy == policy and state.view.kind == "engine"
        ]

    def _lend_others(self, policy: str, plan: LendPlan, except_id: str) -> None:
        """Queue the lends of ``plan`` except ``except_id`` (told in its registration reply)."""
        others = tuple(rid for rid in plan.lend if rid != except_id)
        if others:
            self._lends.put_nowait((policy, replace(plan, lend=others)))

    async def _store(self, resource_id: str) -> None:
        state = self.resources[resource_id]
        record = {
            "resource_id": resource_id,
            "kind": state.view.kind,
            "policy": state.policy,
            "tags": sorted(state.view.tags),
            "slots": list(state.view.slots),
            "lendable": state.view.lendable,
            "role": state.role,
            "phase": state.phase,
            "alive": state.alive,
            "last_seen": state.last_seen,
            "host": state.process[0],
            "pid": state.process[1],
        }
        await self.kv.put(resource_id, orjson.dumps(record))


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def _span_seconds(value: float) -> float:
    """Span attributes cannot be None: -1 stands for unbounded / not measured yet."""
    return -1.0 if math.isinf(value) else value
