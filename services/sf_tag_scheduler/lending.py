"""Lending a trainer's idle slots to rollout, and taking them back.

It owns the trainer's side of the scheduler: ``sched.release`` (the trainer waits: the
policy decides which engines on its slots to lend; they are lent in the background, or,
for a trainer that frees its device memory first, once ``sched.freed`` says it has),
``sched.claim`` (the trainer has a batch: every lent engine is reclaimed before the
reply), the early reclaim on ``batch.<policy>.progress`` and the rebalance once lent
engines serve (``engine.shed.<engine>``: requests moved onto them from the busiest
engines). The decisions are :class:`~sf_tag_scheduler.policy.TagPolicy`'s; the role
changes go through :class:`~sf_tag_scheduler.roles.RoleAssigner`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace

from seamlessflow import telemetry
from seamlessflow.bus import Bus, NoResponder, RemoteError
from seamlessflow.protocol import (
    BatchProgress,
    LendReport,
    ShedReport,
    ShedRequests,
    SlotsClaim,
    SlotsFreed,
    SlotsGranted,
    SlotsReleased,
    check_policy,
)
from sf_tag_scheduler.cores import CoresLending
from sf_tag_scheduler.policy import LendPlan
from sf_tag_scheduler.registry import ResourceRegistry
from sf_tag_scheduler.roles import RoleAssigner
from sf_tag_scheduler.settings import TagSchedulerSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class SlotLending:
    """Lends and reclaims the engines on each policy's training slots."""

    def __init__(
        self,
        bus: Bus,
        registry: ResourceRegistry,
        roles: RoleAssigner,
        cores: CoresLending,
        settings: TagSchedulerSettings,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.roles = roles
        self.cores = cores
        self.settings = settings
        self.early_reclaims: dict[str, asyncio.Task[None]] = {}
        """Per policy, the early reclaim under way (the claim waits for it)."""
        self._lends: asyncio.Queue[tuple[str, LendPlan]] = asyncio.Queue()
        self.held_lends: dict[str, LendPlan] = {}
        """Per policy, the lend decided at a release whose trainer frees its memory
        first: queued at its ``sched.freed``, dropped at its claim."""

    # ------------------------------------------------------------------ the trainer waits

    async def on_release(self, release: SlotsReleased) -> LendReport:
        """The trainer waits: decide now, lend in the background (the trainer goes on)."""
        check_policy(release.policy)
        await self.cores.stop_training(release.policy)
        self.roles.trainer_published(release.policy, release.version)
        decisions = self.registry.decisions(release.policy)
        plan = decisions.trainer_waiting(time.monotonic())
        switched: dict[str, str | float] = {}
        if plan.switch is not None:
            # auto's measured choice changed: on the span (Jaeger, the run's report)
            before = plan.switch.before
            switched = {
                "switch.before": -1.0 if before is None else before,
                "switch.after": plan.switch.after,
                "switch.why": plan.switch.reason,
            }
            log.info("%s: lending switched: %s", release.policy, plan.switch.in_words())
        with tracer.start_as_current_span(
            "sched.decide",
            attributes={
                **switched,
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
            if plan.lend and release.frees_memory:
                # the engines would share the device with the trainer's state: not yet
                self.held_lends[release.policy] = plan
            elif plan.lend:
                self._lends.put_nowait((release.policy, plan))
        log.info(
            "trainer of %s waits (v%d): lend %s: %s",
            release.policy, release.version, list(plan.lend), plan.reason,
        )  # fmt: skip
        return _report(plan)

    async def on_freed(self, freed: SlotsFreed) -> LendReport:
        """The trainer's memory is free: lend what its release decided (what a claim
        has not taken back since)."""
        check_policy(freed.policy)
        plan = self.held_lends.pop(freed.policy, None)
        if plan is None:
            return LendReport(lent=[], reason="nothing held to lend", expected_wait_s=None,
                              gain_s=None, cost_s=0.0)  # fmt: skip
        log.info("trainer of %s freed %.3f GB in %.2fs: lending %s", freed.policy,
                 freed.offloaded_bytes / 1e9, freed.seconds, list(plan.lend))  # fmt: skip
        self._lends.put_nowait((freed.policy, plan))
        return _report(plan)

    def lend_others(self, policy: str, plan: LendPlan, except_id: str) -> None:
        """Queue the lends of ``plan`` except ``except_id`` (told in its registration
        reply, or gone)."""
        others = tuple(rid for rid in plan.lend if rid != except_id)
        if others:
            self._lends.put_nowait((policy, replace(plan, lend=others)))

    async def lend_loop(self) -> None:
        """Lend what was decided, one plan at a time; rebalance onto the engines that
        serve."""
        while True:
            policy, plan = await self._lends.get()
            # A plan waits here while an earlier one is lent (or rebalanced); a claim may
            # have taken its engines back meanwhile (``TagPolicy.lent`` no longer holds
            # them). Lending those now would serve rollout on slots that train.
            lent = self.registry.decisions(policy).lent
            current = tuple(rid for rid in plan.lend if rid in lent)
            if current != plan.lend:
                log.info("lend of %s dropped: reclaimed before it ran",
                         [rid for rid in plan.lend if rid not in lent])  # fmt: skip
                if not current:
                    continue
                plan = replace(plan, lend=current)
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
                acks = await self.roles.assign_all(
                    plan.lend, "rollout", plan.reason, self.settings.lend_timeout_s
                )
                span.set_attribute("seconds", time.monotonic() - started)
            for ack in acks:
                if ack is not None:
                    self.registry.decisions(policy).observe_lend(ack.seconds)
            serving = tuple(rid for rid, ack in zip(plan.lend, acks, strict=True) if ack)
            if serving and self.settings.rebalance_on_lend:
                await self._rebalance_onto(policy, serving)

    async def _rebalance_onto(self, policy: str, targets: tuple[str, ...]) -> None:
        """Freshly lent engines serve: move in-flight requests onto them from the
        busiest engines of the policy (the engines hand them over, the gateway resumes
        them there). Loads are the heartbeats' (up to one interval old); a donor hands
        over at most what it still has."""
        loads = self.registry.serving_loads(policy)
        for rid in targets:
            loads.setdefault(rid, 0)
        plan = self.registry.decisions(policy).shed_plan(loads, targets)
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
            report: ShedReport = await self.bus.request(
                self.bus.subjects.engine_shed(donor),
                ShedRequests(to_engine=target, count=count),
                ShedReport,
                timeout=self.settings.reclaim_timeout_s,
            )
        except (NoResponder, RemoteError) as exc:
            log.warning("%s did not hand requests over: %s", donor, exc)
            return None
        return report

    # ------------------------------------------------------------------ the trainer claims

    async def on_claim(self, claim: SlotsClaim) -> SlotsGranted:
        """Reclaim every lent engine; reply once each released its slot (or timed out),
        an early reclaim still under way included."""
        started = time.monotonic()
        check_policy(claim.policy)
        decisions = self.registry.decisions(claim.policy)
        plan = decisions.trainer_claims(started)
        self.held_lends.pop(claim.policy, None)  # the trainer trains: never lent now
        early = self.early_reclaims.pop(claim.policy, None)
        if early is not None:
            await early  # the slots are the trainer's only once that reclaim is over
        missed = await self._reclaim(
            claim.policy, plan.reclaim, plan.reason, batch_index=claim.batch_index, early=False
        )
        await self.cores.start_training(claim.policy, claim.trainer_id)
        seconds = time.monotonic() - started
        return SlotsGranted(reclaimed=list(plan.reclaim), seconds=seconds, missed=missed)

    async def on_progress(self, progress: BatchProgress) -> None:
        """A group of the next batch is ready: once ``reclaim_early_at`` of them are,
        take the policy's lent engines back while its trainer still waits. (A policy
        with no decisions here, a malformed name included, has nothing lent; an early
        reclaim under way has already emptied ``lent``.)"""
        decisions = self.registry.policies.get(progress.policy)
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
            self.early_reclaims[progress.policy] = asyncio.create_task(
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
            if self.early_reclaims.get(progress.policy) is asyncio.current_task():
                del self.early_reclaims[progress.policy]

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
            acks = await self.roles.assign_all(
                engines, "idle", reason, self.settings.reclaim_timeout_s
            )
            seconds = time.monotonic() - started
            missed = [rid for rid, ack in zip(engines, acks, strict=True) if ack is None]
            span.set_attribute("seconds", seconds)
            span.set_attribute("handed_back", sum(a.handed_back for a in acks if a))
            span.set_attribute("lent_busy_s", sum(a.busy_s for a in acks if a))
            span.set_attribute("missed", missed)
        if engines:
            self.registry.decisions(policy).observe_reclaim(seconds)
            log.info("reclaimed %s%s in %.3fs (missed %s)",
                     list(engines), " early" if early else "", seconds, missed)  # fmt: skip
        return missed


def _finite(value: float) -> float | None:
    return None if math.isinf(value) else value


def _report(plan: LendPlan) -> LendReport:
    """What the trainer is told of ``plan``."""
    return LendReport(
        lent=list(plan.lend),
        reason=plan.reason,
        expected_wait_s=_finite(plan.expected_wait_s),
        gain_s=_finite(plan.gain_s),
        cost_s=plan.cost_s,
    )


def _span_seconds(value: float) -> float:
    """Span attributes cannot be None: -1 stands for unbounded / not measured yet."""
    return -1.0 if math.isinf(value) else value
