"""tag-scheduler: the registry of resources, their tags, roles, phases and liveness.

Consumes:
- ``sf.<run>.sched.register`` (request ResourceRegister -> reply RoleAssignment)
- ``sf.<run>.sched.heartbeat.<resource>`` (Heartbeat, core)
Produces:
- ``sf.<run>.sched.assign.<resource>`` (RoleAssignment, when a role changes)
- ``sf.<run>.sched.phase`` (PhaseChanged: phase transitions and deaths)
- KV bucket ``sf_<run>_resources``: one entry per resource (tags, role, phase, status)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import orjson

from seamlessflow.protocol import (
    Heartbeat,
    PhaseChanged,
    ResourceRegister,
    RoleAssignment,
    check_token,
    decode,
)
from seamlessflow.service import ServiceContext, supervise
from sf_tag_scheduler.config import TagSchedulerSettings
from sf_tag_scheduler.policy import ResourceView, StaticTagPolicy

log = logging.getLogger(__name__)


@dataclass
class ResourceState:
    view: ResourceView
    role: str
    phase: str = "idle"
    last_seen: float = 0.0
    alive: bool = True


class TagScheduler:
    name = "tag-scheduler"

    def __init__(self, settings: TagSchedulerSettings | None = None) -> None:
        self.settings = settings or TagSchedulerSettings()
        self.policy = StaticTagPolicy(self.settings.mode)
        self.resources: dict[str, ResourceState] = {}
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        self.kv = await ctx.bus.js.create_key_value(bucket=ctx.subjects.kv_resources())
        await ctx.bus.serve(ctx.subjects.sched_register(), ResourceRegister, self.on_register)
        await ctx.bus.nc.subscribe(ctx.subjects.sched_heartbeat_all(), cb=self._on_heartbeat_msg)
        log.info("tag-scheduler up (mode=%s)", self.settings.mode)
        self.ready.set()
        await supervise(ctx.stopping, self._liveness_loop())

    async def on_register(self, request: ResourceRegister) -> RoleAssignment:
        check_token(request.resource_id, "resource id")
        view = ResourceView(request.resource_id, request.kind, frozenset(request.tags))
        decision = self.policy.assign(view)
        self.resources[request.resource_id] = ResourceState(
            view=view, role=decision.role, last_seen=time.time()
        )
        await self._store(request.resource_id)
        log.info(
            "registered %s %s tags=%s -> %s",
            request.kind,
            request.resource_id,
            sorted(request.tags),
            decision.role,
        )
        return RoleAssignment(
            resource_id=request.resource_id, role=decision.role, reason=decision.reason
        )

    async def _on_heartbeat_msg(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            beat = decode(msg.data, Heartbeat)
        except ValueError:
            log.warning("dropping malformed heartbeat on %s", msg.subject)
            return
        state = self.resources.get(beat.resource_id)
        if state is None:
            return  # not registered (yet); its register request will follow
        state.last_seen = time.time()
        revived = not state.alive
        state.alive = True
        if beat.phase != state.phase or revived:
            state.phase = beat.phase
            await self.ctx.bus.publish(
                self.ctx.subjects.sched_phase(),
                PhaseChanged(resource_id=beat.resource_id, phase=beat.phase),
            )
            await self._store(beat.resource_id)

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.check_interval_s)
            now = time.time()
            for resource_id, state in self.resources.items():
                if state.alive and now - state.last_seen > self.settings.dead_after_s:
                    state.alive = False
                    log.warning("resource %s missed heartbeats: declared dead", resource_id)
                    await self.ctx.bus.publish(
                        self.ctx.subjects.sched_phase(),
                        PhaseChanged(resource_id=resource_id, phase="dead"),
                    )
                    await self._store(resource_id)

    async def _store(self, resource_id: str) -> None:
        state = self.resources[resource_id]
        record = {
            "resource_id": resource_id,
            "kind": state.view.kind,
            "tags": sorted(state.view.tags),
            "role": state.role,
            "phase": state.phase,
            "alive": state.alive,
            "last_seen": state.last_seen,
        }
        await self.kv.put(resource_id, orjson.dumps(record))
