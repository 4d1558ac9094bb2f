"""A resource's side of the tag-scheduler contract: register, heartbeat, follow assignments.

Every process that holds compute (an engine worker, a trainer rank) owns one
:class:`ResourceMembership`. It registers its capability tags (and the slots it runs
on) with the tag-scheduler, retrying until the scheduler answers, then heartbeats with
its current phase. The registration reply sets the first role; later role changes are
requests on the resource's assignment subject: the process applies the change (an
engine leaves or joins the generate queue) and only then acks with ``RoleAck``, so the
scheduler knows when a slot is really free. A process must not serve its role before
``wait_for_role`` returns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import NamedTuple

from opentelemetry import trace

from seamlessflow import telemetry
from seamlessflow.bus import Bus, NoResponder
from seamlessflow.protocol import (
    POLICY_TAG_PREFIX,
    Heartbeat,
    Phase,
    ResourceRegister,
    Role,
    RoleAck,
    RoleAssignment,
    policy_of_tags,
    policy_tag,
)
from seamlessflow.retry import RetryPolicy, retry

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0

REGISTER_RETRY = RetryPolicy(
    retry_on=(NoResponder,), first_delay_s=0.1, backoff=2.0, max_delay_s=2.0
)
"""A registration nobody answers (the tag-scheduler starts after us, or restarts) is sent
again after 0.1 s, doubling to 2 s, until the scheduler answers."""


class RoleOutcome(NamedTuple):
    """What putting a role into effect did (reported in the RoleAck)."""

    handed_back: int = 0
    """Requests in flight interrupted for re-submission elsewhere (leaving rollout)."""
    busy_s: float = 0.0
    """Seconds with requests in flight since it last joined rollout (leaving rollout)."""


RoleHandler = Callable[[RoleAssignment], Awaitable[RoleOutcome]]
"""Puts a role into effect before it is acked."""


class ResourceMembership:
    def __init__(
        self,
        bus: Bus,
        resource_id: str,
        kind: str,
        tags: list[str],
        slots: list[str] | None = None,
        on_role: RoleHandler | None = None,
    ) -> None:
        self.bus = bus
        self.resource_id = resource_id
        self.kind = kind
        # The tag-scheduler lends and reclaims per policy: every resource names its own.
        if any(t.startswith(POLICY_TAG_PREFIX) for t in tags):
            if policy_of_tags(tags) != bus.subjects.policy:
                raise ValueError(
                    f"tags {tags} name another policy than this process's "
                    f"{bus.subjects.policy!r} (SF_POLICY)"
                )
            self.tags = list(tags)
        else:
            self.tags = [*tags, policy_tag(bus.subjects.policy)]
        self.slots = slots or [resource_id]
        self.on_role = on_role
        self._applying = asyncio.Lock()
        self.role: Role | None = None
        self.phase: Phase = "idle"
        self.in_flight = 0
        self.version = 0
        self._role_changed = asyncio.Condition()
        self._phase_span: trace.Span | None = None
        self._beat_now = asyncio.Event()
        """Set on a phase change: the heartbeat goes at once, not at the next tick (the
        tag-scheduler lends an idle engine's cores to training on it)."""
        bus.on_reconnect(self._beat_at_once)

    async def register(self) -> RoleAssignment:
        """Register until the scheduler answers (it may start after us)."""
        await self.bus.serve(
            self.bus.subjects.sched_assignment(self.resource_id),
            RoleAssignment,
            self._on_assignment,
        )
        request = ResourceRegister(
            resource_id=self.resource_id,
            kind=self.kind,
            tags=self.tags,
            host=socket.gethostname(),
            pid=os.getpid(),
            slots=self.slots,
        )

        async def ask() -> RoleAssignment:
            assignment: RoleAssignment = await self.bus.request(
                self.bus.subjects.sched_register(), request, RoleAssignment, timeout=2.0
            )
            return assignment

        assignment = await retry(ask, REGISTER_RETRY)
        await self._apply(assignment)
        return assignment

    @contextlib.asynccontextmanager
    async def transition(self) -> AsyncIterator[None]:
        """Hold off role changes (the process is setting itself up for its role)."""
        async with self._applying:
            yield

    async def _on_assignment(self, assignment: RoleAssignment) -> RoleAck:
        started = time.monotonic()
        outcome = await self._apply(assignment)
        return RoleAck(
            resource_id=self.resource_id,
            role=assignment.role,
            seconds=time.monotonic() - started,
            handed_back=outcome.handed_back,
            busy_s=outcome.busy_s,
        )

    async def _apply(self, assignment: RoleAssignment) -> RoleOutcome:
        """Put the role into effect, one change at a time, then publish it."""
        async with self._applying:
            outcome = RoleOutcome()
            if self.on_role is not None:
                outcome = await self.on_role(assignment)
            async with self._role_changed:
                if assignment.role != self.role:
                    log.info(
                        "%s: role %s (%s)", self.resource_id, assignment.role, assignment.reason
                    )
                self.role = assignment.role
                self._role_changed.notify_all()
            return outcome

    async def wait_for_role(self, *roles: Role) -> Role:
        async with self._role_changed:
            await self._role_changed.wait_for(lambda: self.role in roles)
            assert self.role is not None
            return self.role

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase``; each phase interval is one span (the timeline's lanes)."""
        if phase == self.phase and self._phase_span is not None:
            return
        self.end_phase()
        self.phase = phase
        self._beat_now.set()
        self._phase_span = telemetry.tracer(__name__).start_span(
            f"phase.{phase}",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a root: lanes, not trees
            attributes={
                "resource.id": self.resource_id,
                "resource.kind": self.kind,
                "resource.slots": self.slots,
                "phase": phase,
            },
        )

    def end_phase(self) -> None:
        if self._phase_span is not None:
            self._phase_span.end()
            self._phase_span = None

    async def leave(self) -> None:
        """Tell the tag-scheduler this process stops cleanly (its last heartbeat). Best
        effort: with NATS already gone the scheduler declares it dead later instead."""
        beat = Heartbeat(
            resource_id=self.resource_id, phase=self.phase, version=self.version, leaving=True
        )
        try:
            await self.bus.publish(self.bus.subjects.sched_heartbeat(self.resource_id), beat)
        except Exception as exc:  # a stopping process: the reason is logged, nothing raised
            log.info("%s: could not say it leaves (%s)", self.resource_id, exc)

    async def _beat_at_once(self) -> None:
        """NATS came back: the next beat (with the new ``connection``) goes now, so that
        the gateway re-routes what this resource held without waiting a tick."""
        self._beat_now.set()

    async def heartbeat_loop(self) -> None:
        subject = self.bus.subjects.sched_heartbeat(self.resource_id)
        while True:
            await self.bus.publish(
                subject,
                Heartbeat(
                    resource_id=self.resource_id,
                    phase=self.phase,
                    in_flight=self.in_flight,
                    version=self.version,
                    connection=self.bus.reconnects,
                ),
            )
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the inner
            # wait's result when a beat is asked for as the loop is cancelled, swallowing
            # the cancel (the loop then beat for ever and its service never stopped)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(HEARTBEAT_INTERVAL_S):
                    await self._beat_now.wait()
            self._beat_now.clear()
