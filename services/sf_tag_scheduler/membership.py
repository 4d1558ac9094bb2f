"""Who is in the pool and alive: registration, heartbeats, and retiring the gone.

It owns ``sched.register`` (ResourceRegister -> RoleAssignment: a resource joins, or
joins again, and is told its role), ``sched.heartbeat.<resource>`` (each beat keeps its
resource alive and carries its phase and load) and the liveness check that declares
dead a resource whose heartbeats stopped. Each phase change, each death and each NATS
reconnect of a resource is announced on ``sched.phase`` (PhaseChanged: the gateway
re-routes what a dead or reconnected engine held).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    Heartbeat,
    Phase,
    PhaseChanged,
    ResourceRegister,
    RoleAssignment,
    check_token,
    policy_of_tags,
)
from sf_tag_scheduler.cores import CoresLending
from sf_tag_scheduler.lending import SlotLending
from sf_tag_scheduler.policy import ResourceView
from sf_tag_scheduler.registry import ResourceRegistry, ResourceState
from sf_tag_scheduler.roles import RoleAssigner
from sf_tag_scheduler.settings import TagSchedulerSettings

log = logging.getLogger(__name__)


class Membership:
    """Registers the resources of ``registry`` and follows their heartbeats."""

    def __init__(
        self,
        bus: Bus,
        registry: ResourceRegistry,
        roles: RoleAssigner,
        lending: SlotLending,
        cores: CoresLending,
        settings: TagSchedulerSettings,
    ) -> None:
        self.bus = bus
        self.registry = registry
        self.roles = roles
        self.lending = lending
        self.cores = cores
        self.settings = settings

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
        previous = self.registry.resources.get(request.resource_id)
        if previous is not None and previous.policy != policy:
            self.registry.decisions(previous.policy).forget(request.resource_id)
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
            await self._announce(request.resource_id, "dead")
        decisions = self.registry.decisions(policy)
        decisions.add(view)
        # A lendable engine joining while its trainer waits may be lent at once.
        self.lending.lend_others(policy, decisions.rebalance(time.monotonic()), request.resource_id)
        decision = decisions.role_of(request.resource_id)
        self.registry.resources[request.resource_id] = ResourceState(
            view=view,
            policy=policy,
            role=decision.role,
            last_seen=time.time(),
            process=(request.host, request.pid),
        )
        await self.registry.store(request.resource_id)
        log.info(
            "registered %s %s tags=%s slots=%s -> %s",
            request.kind,
            request.resource_id,
            sorted(request.tags),
            list(view.slots),
            decision.role,
        )
        return self.roles.assignment(request.resource_id, decision.role, decision.reason)

    # ------------------------------------------------------------------ liveness

    async def on_heartbeat(self, beat: Heartbeat) -> None:
        state = self.registry.resources.get(beat.resource_id)
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
            self.registry.decisions(state.policy).revive(beat.resource_id)
            self.roles.tell_again(beat.resource_id)
        if beat.phase != state.phase or revived:
            state.phase = beat.phase
            await self._announce(beat.resource_id, beat.phase)
            await self.registry.store(beat.resource_id)
        if state.connection is not None and beat.connection > state.connection:
            # What it sent while its connection was down may be lost (a reply to the
            # gateway written to a dead server's socket): the gateway re-routes its calls.
            log.warning("resource %s reconnected to NATS", beat.resource_id)
            await self._announce(beat.resource_id, "reconnected")
        state.connection = beat.connection
        if (load_changed or revived) and state.view.kind == "engine":
            await self.cores.update(state.policy)

    async def liveness_loop(self) -> None:
        """Every ``check_interval_s``: declare dead each resource whose last heartbeat
        is older than ``dead_after_s``."""
        while True:
            await asyncio.sleep(self.settings.check_interval_s)
            now = time.time()
            for resource_id, state in list(self.registry.resources.items()):
                if state.alive and now - state.last_seen > self.settings.dead_after_s:
                    log.warning("resource %s missed heartbeats: declared dead", resource_id)
                    await self._retire(resource_id, state)

    async def _retire(self, resource_id: str, state: ResourceState) -> None:
        """``resource_id`` is gone (it left, or missed its heartbeats): out of the
        decisions, announced as dead (the gateway re-routes what it held), stored."""
        state.alive = False
        decisions = self.registry.decisions(state.policy)
        decisions.remove(resource_id)
        await self._announce(resource_id, "dead")
        await self.registry.store(resource_id)
        self.lending.lend_others(state.policy, decisions.rebalance(time.monotonic()), resource_id)
        await self.cores.update(state.policy)

    async def _announce(
        self, resource_id: str, phase: Phase | Literal["dead", "reconnected"]
    ) -> None:
        await self.bus.publish(
            self.bus.subjects.sched_phase(), PhaseChanged(resource_id=resource_id, phase=phase)
        )
