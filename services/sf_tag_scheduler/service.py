"""tag-scheduler: resources, tags, roles, phases, liveness, and lending training slots.

Consumes:
- ``sf.<run>.sched.register`` (request ResourceRegister -> reply RoleAssignment)
- ``sf.<run>.sched.heartbeat.<resource>`` (Heartbeat, core)
- ``sf.<run>.sched.claim`` (request SlotsClaim -> SlotsGranted): the trainer has a
  batch; every engine lent from its slots is reclaimed before the reply
- ``sf.<run>.sched.release`` (request SlotsReleased -> LendReport): the trainer waits;
  the policy decides which engines on its slots to lend; with ``frees_memory`` they
  are lent only at the trainer's
- ``sf.<run>.sched.freed`` (request SlotsFreed -> LendReport): that trainer moved its
  state off the device (``SF_TRAINER_OFFLOAD_WHEN_LENT``)
- ``sf.<run>.batch.<policy>.progress`` (BatchProgress, core, from the trajectory
  service): with ``SF_TAG_SCHEDULER_RECLAIM_EARLY_AT`` < 1, once that share of the next
  batch's groups is ready the lent engines are taken back while the trainer still
  waits (the early reclaim); the claim then waits for that reclaim to end
Produces:
- ``sf.<run>.sched.assign.<resource>`` (request RoleAssignment -> RoleAck): role
  changes (lend: ``rollout``; reclaim: ``idle``), acked once in effect
- ``sf.<run>.engine.shed.<engine>`` (request ShedRequests -> ShedReport): rebalance
  on lend, once lent engines serve (``rebalance.shed_plan`` over the loads the
  engines' heartbeats report)
- ``sf.<run>.sched.cores.<trainer>`` (CoresLent, core): with
  ``SF_TAG_SCHEDULER_LEND_CORES_TO_TRAINING``, while a trainer trains (claim to
  release), the cores of the dedicated rollout engines on its host that have nothing
  to do (``idle_cores.cores_for_training``); sent on every change, 0 threads when the
  engines take them back or the trainer stops training
- ``sf.<run>.sched.phase`` (PhaseChanged: phase transitions, deaths, and NATS
  reconnects, from a heartbeat whose ``connection`` grew)
- KV bucket ``sf_<run>_resources``: one entry per resource (tags, slots, role, phase,
  status, process); read back on start-up, so a restarted scheduler knows every
  resource again without asking it to register (see ``ResourceRegistry.restore``)
- spans ``sched.decide`` (each lending decision and its estimates; in mode ``auto``,
  ``switch.before`` / ``switch.after`` / ``switch.why`` where the measured choice
  changed, which the run's report lists as ``lending_switches``), ``sched.lend`` and
  ``sched.reclaim`` (the switches and their cost; ``early`` for an early reclaim),
  ``sched.rebalance`` (requests moved onto lent engines)

The decisions are pure: :class:`sf_tag_scheduler.policy.TagPolicy` (roles and lending
plans, the same object the simulator drives) with ``when_pays`` (the measured rule),
``rebalance`` (the shed plan) and ``idle_cores`` (cores for training). The I/O around
them is in these parts, each a module of this package, composed by ``run`` below:

- ``registry``: the resources, each policy's decisions, their record in the KV bucket;
- ``membership``: ``sched.register``, heartbeats, declaring the silent dead, ``sched.phase``;
- ``lending``: ``sched.release`` / ``sched.claim``, the early reclaim, lending in the
  background and the rebalance onto lent engines (``engine.shed``);
- ``roles`` (``sched.assign``) and ``cores`` (``sched.cores``), which the others use.

Multi-policy: every resource names its policy with a ``policy:<name>`` tag (default
``policy``), and each policy's trainer claims and releases for that policy. The
scheduler keeps one ``TagPolicy`` per policy: an engine is lent only while the trainer
of its own policy waits, and reclaimed when that trainer claims. (Lending a slot to
another policy's rollout would need the engine to swap models; not done.)
"""

from __future__ import annotations

import asyncio
import logging

from seamlessflow.protocol import (
    DEFAULT_POLICY,
    BatchProgress,
    Heartbeat,
    ResourceRegister,
    SlotsClaim,
    SlotsFreed,
    SlotsReleased,
)
from seamlessflow.service import ServiceContext, supervise
from sf_tag_scheduler.cores import CoresLending
from sf_tag_scheduler.lending import SlotLending
from sf_tag_scheduler.membership import Membership
from sf_tag_scheduler.policy import TagPolicy
from sf_tag_scheduler.registry import ResourceRegistry, ResourceState
from sf_tag_scheduler.roles import RoleAssigner
from sf_tag_scheduler.settings import TagSchedulerSettings

log = logging.getLogger(__name__)


class TagSchedulerService:
    name = "tag-scheduler"

    def __init__(self, settings: TagSchedulerSettings | None = None) -> None:
        self.settings = settings or TagSchedulerSettings()
        self.registry = ResourceRegistry(self.settings.policy_config)
        self.ready = asyncio.Event()
        # the parts that talk over the bus, made by ``run`` once it is connected
        self.roles: RoleAssigner
        self.cores: CoresLending
        self.lending: SlotLending
        self.membership: Membership

    async def run(self, ctx: ServiceContext) -> None:
        bus = ctx.bus
        # restored before anything is served: a restarted scheduler answers as one that
        # never stopped (the resources it knew, without asking them to register again)
        stale_roles = await self.registry.open(bus)
        self.roles = RoleAssigner(bus, self.registry, self.settings.reclaim_timeout_s)
        self.cores = CoresLending(bus, self.registry, enabled=self.settings.lend_cores_to_training)
        self.lending = SlotLending(bus, self.registry, self.roles, self.cores, self.settings)
        self.membership = Membership(
            bus, self.registry, self.roles, self.lending, self.cores, self.settings
        )
        for resource_id in stale_roles:
            self.roles.tell_again(resource_id)
        subjects = ctx.subjects
        await bus.serve(subjects.sched_register(), ResourceRegister, self.membership.on_register)
        await bus.serve(subjects.sched_claim(), SlotsClaim, self.lending.on_claim)
        await bus.serve(subjects.sched_release(), SlotsReleased, self.lending.on_release)
        await bus.serve(subjects.sched_freed(), SlotsFreed, self.lending.on_freed)
        await bus.subscribe(subjects.sched_heartbeat_all(), Heartbeat, self.membership.on_heartbeat)
        if self.settings.reclaim_early_at < 1:
            await bus.subscribe(
                subjects.batch_progress_all(), BatchProgress, self.lending.on_progress
            )
        log.info("tag-scheduler up (mode=%s)", self.settings.mode)
        self.ready.set()
        await supervise(
            ctx.stopping,
            self.membership.liveness_loop(),
            self.lending.lend_loop(),
            self.roles.reassign_loop(),
        )

    # ------------------------------------------------------------------ what tests and tools read
    # (the state of the parts below exists from ``run`` on: the parts are made there)

    @property
    def resources(self) -> dict[str, ResourceState]:
        """Every resource the scheduler knows, by id."""
        return self.registry.resources

    @property
    def policies(self) -> dict[str, TagPolicy]:
        """Policy name -> the decisions for its resources and its trainer."""
        return self.registry.policies

    def decisions(self, policy: str = DEFAULT_POLICY) -> TagPolicy:
        """The scheduling policy object of one (RL) policy, made on first use."""
        return self.registry.decisions(policy)

    @property
    def trainer_versions(self) -> dict[str, int]:
        """Per policy, the newest version its trainer released its slots with."""
        return self.roles.trainer_versions

    @property
    def training(self) -> dict[str, str]:
        """Per policy, the trainer that claimed its slots and has not released them."""
        return self.cores.training

    @property
    def cores_lent(self) -> dict[str, tuple[str, ...]]:
        """Per policy, the engines whose cores its trainer was last told of."""
        return self.cores.cores_lent

    @property
    def _early_reclaims(self) -> dict[str, asyncio.Task[None]]:
        """Per policy, the early reclaim under way."""
        return self.lending.early_reclaims
