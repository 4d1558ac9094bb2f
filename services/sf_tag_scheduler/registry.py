"""The resource registry: every resource the tag-scheduler knows, and its durable record.

It owns ``resources`` (one :class:`ResourceState` per registered engine or trainer), the
decisions of each (RL) policy's pool (one :class:`TagPolicy` per policy, made on first
use), and the KV bucket ``sf_<run>_resources``: one entry per resource (tags, slots,
role, phase, status, process), written on every change and read back on start-up, so
that a restarted scheduler knows every resource again without asking it to register.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from seamlessflow.bus import Bus, KeyValueBucket
from seamlessflow.protocol import DEFAULT_POLICY
from sf_tag_scheduler.idle_cores import EngineLoad
from sf_tag_scheduler.policy import PolicyConfig, ResourceView, TagPolicy

log = logging.getLogger(__name__)


@dataclass
class ResourceState:
    """What the scheduler knows of one resource (stored whole in the bucket)."""

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
    connection: int | None = None
    """Its last heartbeat's ``connection`` (reconnects of its NATS client); None until
    the first beat after it registered or was restored, which announces nothing."""


class ResourceRegistry:
    """The resources, each policy's decisions, and the bucket that stores the resources."""

    def __init__(self, policy_config: Callable[[], PolicyConfig]) -> None:
        self.policy_config = policy_config
        """Makes the configuration of a new policy's decisions (the settings')."""
        self.resources: dict[str, ResourceState] = {}
        self.policies: dict[str, TagPolicy] = {}
        """Policy name -> the decisions for its resources and its trainer."""
        self.kv: KeyValueBucket
        """The bucket ``sf_<run>_resources``, from :meth:`open` on."""

    def decisions(self, policy: str = DEFAULT_POLICY) -> TagPolicy:
        """The scheduling policy object of one (RL) policy, made on first use."""
        decisions = self.policies.get(policy)
        if decisions is None:
            decisions = self.policies[policy] = TagPolicy(self.policy_config())
        return decisions

    async def open(self, bus: Bus) -> list[str]:
        """Open the bucket and restore what it holds (:meth:`restore`)."""
        self.kv = await bus.key_value(bus.subjects.kv_resources())
        return await self.restore()

    async def restore(self) -> list[str]:
        """After a restart: every resource recorded in the KV bucket, as if it had just
        registered. Its heartbeats keep it alive (or it is declared dead after
        ``dead_after_s``). Lending decisions and their measurements start afresh.
        Returns the live resources whose recorded role differs from what the policy
        says now (an engine lent before the restart): they are to be told their role."""
        stale: list[str] = []
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
                stale.append(view.resource_id)
        if self.resources:
            log.info("restored %d resources from the KV bucket", len(self.resources))
        return stale

    async def store(self, resource_id: str) -> None:
        """Write ``resource_id``'s record to the bucket (its current state, whole)."""
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

    def engine_loads(self, policy: str) -> list[EngineLoad]:
        """Every engine of ``policy`` (dead ones included) as its heartbeats show it."""
        return [
            EngineLoad(state.view, state.process[0], state.phase, state.in_flight, state.alive)
            for state in self.resources.values()
            if state.policy == policy and state.view.kind == "engine"
        ]

    def serving_loads(self, policy: str) -> dict[str, int]:
        """Requests in flight on each live engine of ``policy`` in role ``rollout``, as
        its last heartbeat said (up to one interval old)."""
        return {
            rid: state.in_flight
            for rid, state in self.resources.items()
            if state.policy == policy
            and state.alive
            and state.view.kind == "engine"
            and state.role == "rollout"
        }
