"""The tag-scheduler's messages: resources, roles, liveness, lending slots and cores."""

from __future__ import annotations

import time
from typing import Literal

import msgspec

from seamlessflow.protocol.base import DEFAULT_POLICY, Message

Role = Literal["rollout", "train", "idle"]
Phase = Literal["rollout", "train", "sync", "idle"]


class ResourceRegister(Message, tag="sched.register"):
    """any resource -> tag-scheduler (request): I exist, with these capability tags."""

    resource_id: str
    kind: str
    tags: list[str]
    host: str = ""
    pid: int = 0
    slots: list[str] = msgspec.field(default_factory=list)
    """Physical slots (cores, GPUs) this process computes on; empty = its own id. An
    engine and a trainer sharing a slot are one resource in time: the timeline's lane."""


class RoleAssignment(Message, tag="sched.assignment"):
    """tag-scheduler -> resource (registration reply, or a request on the resource's
    assignment subject answered with RoleAck): the role it should play now."""

    resource_id: str
    role: Role
    reason: str
    min_version: int = 0
    """``rollout``: serve no older weight version than this (the version the trainer
    just published), even if weight-sync has not announced it yet."""


class RoleAck(Message, tag="sched.role_ack"):
    """resource -> tag-scheduler (reply to RoleAssignment): the role is in effect.

    An engine acks ``rollout`` once it serves the current weight version and takes
    requests; ``idle`` once it left the queue, handed its in-flight requests back for
    transparent resume and released its memory."""

    resource_id: str
    role: Role
    seconds: float
    """How long the transition took on the resource."""
    handed_back: int = 0
    """Requests in flight that were interrupted for re-submission elsewhere."""
    busy_s: float = 0.0
    """``idle`` after serving: seconds it had requests in flight since it last joined
    the generate queue (what lending it yielded)."""


class SlotsClaim(Message, tag="sched.claim"):
    """trainer -> tag-scheduler (request): a batch is ready; reclaim my lent slots."""

    trainer_id: str
    batch_index: int = -1
    policy: str = DEFAULT_POLICY
    """Whose slots: the scheduler lends and reclaims only engines tagged ``policy:<name>``."""


class SlotsGranted(Message, tag="sched.granted"):
    """tag-scheduler -> trainer: every lent engine on the training slots released them
    (or missed the deadline and is treated as gone)."""

    reclaimed: list[str]
    seconds: float
    missed: list[str] = msgspec.field(default_factory=list)


class CoresLent(Message, tag="sched.cores"):
    """tag-scheduler -> trainer (core, lossy: each message replaces the last): while it
    trains, the dedicated rollout engines on its host that have nothing to generate lend
    it their cores; it trains on ``threads`` more intra-op threads until the next
    message. Sent on every change (an engine going idle or busy, a claim, a release)."""

    trainer_id: str
    threads: int
    """Extra threads the trainer may run now (0: none; the cores went back)."""
    engines: list[str] = msgspec.field(default_factory=list)
    """The idle engines whose slots these are."""
    policy: str = DEFAULT_POLICY


class SlotsReleased(Message, tag="sched.released"):
    """trainer -> tag-scheduler (request): the step's weights are published; I wait."""

    trainer_id: str
    version: int
    policy: str = DEFAULT_POLICY
    frees_memory: bool = False
    """The trainer frees its device memory before its slots serve rollout: the engines
    the reply names are lent only once it says so (SlotsFreed)."""


class SlotsFreed(Message, tag="sched.freed"):
    """trainer -> tag-scheduler (request): after a SlotsReleased with ``frees_memory``
    whose reply lent engines, the trainer has moved its state to host memory; those
    engines may use the slots now. The reply names the engines still to be lent (none
    when a claim took them back first)."""

    trainer_id: str
    policy: str = DEFAULT_POLICY
    offloaded_bytes: int = 0
    """What the trainer's ranks 0 moved off its device (its log has every rank's)."""
    seconds: float = 0.0


class LendReport(Message, tag="sched.lend"):
    """tag-scheduler -> trainer: what the policy decided for the wait that starts now."""

    lent: list[str]
    reason: str
    expected_wait_s: float | None
    """The trainer's expected wait with dedicated engines alone; None = unbounded."""
    gain_s: float | None
    cost_s: float


class Heartbeat(Message, tag="sched.heartbeat"):
    """resource -> tag-scheduler (core, lossy): still alive; current phase and load."""

    resource_id: str
    phase: Phase = "idle"
    in_flight: int = 0
    version: int = 0
    sent_at: float = msgspec.field(default_factory=time.time)
    connection: int = 0
    """How many times this process's NATS connection came back (``Bus.reconnects``).
    When it grows, the tag-scheduler announces the resource "reconnected": what it sent
    while away may be lost, replies to the gateway included."""
    leaving: bool = False
    """The last beat of a process that stops cleanly: the tag-scheduler retires it now
    (a "left" line, not a "missed heartbeats" warning ``dead_after_s`` later)."""


class PhaseChanged(Message, tag="sched.phase"):
    """tag-scheduler -> gateway and weight-sync (core): a resource changed phase, was
    declared dead, or reconnected to NATS (its heartbeat's ``connection`` grew)."""

    resource_id: str
    phase: Phase | Literal["dead", "reconnected"]
    at: float = msgspec.field(default_factory=time.time)
