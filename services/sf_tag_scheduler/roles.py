"""Telling resources their roles: ``sched.assign.<resource>`` (RoleAssignment -> RoleAck).

It owns the assignment a resource is sent (a lent engine's weight floor included: it
serves no older weights than its trainer last published), asking for it and recording
the role once acked, and the queue of resources to tell again: one back from the dead,
or restored with a role the policy no longer gives it.
"""

from __future__ import annotations

import asyncio
import logging

from seamlessflow.bus import Bus, NoResponder, RemoteError
from seamlessflow.protocol import DEFAULT_POLICY, Role, RoleAck, RoleAssignment
from sf_tag_scheduler.registry import ResourceRegistry

log = logging.getLogger(__name__)


class RoleAssigner:
    """Sends roles to the resources of ``registry`` over ``bus``."""

    def __init__(self, bus: Bus, registry: ResourceRegistry, reassign_timeout_s: float) -> None:
        self.bus = bus
        self.registry = registry
        self.reassign_timeout_s = reassign_timeout_s
        """Longest a resource told its role again may take to ack."""
        self.trainer_versions: dict[str, int] = {}
        """Per policy, the newest version its trainer released its slots with: engines
        lent to it serve no older weights."""
        self._reassign: asyncio.Queue[str] = asyncio.Queue()

    def trainer_published(self, policy: str, version: int) -> None:
        """The trainer of ``policy`` released its slots with ``version`` published."""
        self.trainer_versions[policy] = max(self.trainer_versions.get(policy, 0), version)

    def assignment(self, resource_id: str, role: Role, reason: str) -> RoleAssignment:
        # a lent engine serves no older weights than its trainer just published
        state = self.registry.resources.get(resource_id)
        policy = state.policy if state is not None else DEFAULT_POLICY
        min_version = self.trainer_versions.get(policy, 0) if role == "rollout" else 0
        return RoleAssignment(
            resource_id=resource_id, role=role, reason=reason, min_version=min_version
        )

    async def assign_all(
        self, resource_ids: tuple[str, ...], role: Role, reason: str, timeout: float
    ) -> list[RoleAck | None]:
        """:meth:`assign` to each of ``resource_ids`` at once; the acks in their order."""
        return await asyncio.gather(
            *(self.assign(rid, role, reason, timeout) for rid in resource_ids)
        )

    async def assign(
        self, resource_id: str, role: Role, reason: str, timeout: float
    ) -> RoleAck | None:
        """Ask a resource to take ``role``; None if it did not ack in time (or refused)."""
        state = self.registry.resources.get(resource_id)
        if state is not None:
            state.role = role
        try:
            ack: RoleAck = await self.bus.request(
                self.bus.subjects.sched_assignment(resource_id),
                self.assignment(resource_id, role, reason),
                RoleAck,
                timeout=timeout,
            )
        except (NoResponder, RemoteError) as exc:
            log.warning("%s did not take role %s: %s", resource_id, role, exc)
            return None
        if state is not None:
            await self.registry.store(resource_id)
        return ack

    def tell_again(self, resource_id: str) -> None:
        """Queue ``resource_id`` to be told the role it should play now."""
        self._reassign.put_nowait(resource_id)

    async def reassign_loop(self) -> None:
        """A resource back from the dead is told the role it should play now (it may
        still believe in a lend that was cancelled when it was declared dead)."""
        while True:
            resource_id = await self._reassign.get()
            decisions = self.registry.decisions(self.registry.resources[resource_id].policy)
            if resource_id in decisions.members:
                decision = decisions.role_of(resource_id)
                await self.assign(
                    resource_id, decision.role, decision.reason, self.reassign_timeout_s
                )
