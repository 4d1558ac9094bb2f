"""The trainer's side of slot lending: claim its slots before a step, release them after.

A trainer's slots are lent to rollout while it waits for a batch (``sf_tag_scheduler``).
A scheduler that does not answer never blocks training: the trainer logs it and goes on.
A trainer that offloads while lent (``SF_TRAINER_OFFLOAD_WHEN_LENT``) releases with
``frees_memory``: the engines are lent once it has offloaded and said so (``freed``),
never beside its state on the device.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from seamlessflow.bus import Bus, NoResponder, RemoteError
from seamlessflow.protocol import (
    LendReport,
    Message,
    SlotsClaim,
    SlotsFreed,
    SlotsGranted,
    SlotsReleased,
)

log = logging.getLogger(__name__)
R = TypeVar("R", bound=Message)


class TrainingSlots:
    """``sched.claim`` / ``sched.release`` for the trainer ``trainer_id`` of ``policy``."""

    def __init__(self, bus: Bus, trainer_id: str, policy: str, timeout_s: float) -> None:
        self.bus = bus
        self.trainer_id = trainer_id
        self.policy = policy
        self.timeout_s = timeout_s
        """Longest wait for the scheduler's answer (``SF_TRAINER_CLAIM_TIMEOUT_S``)."""

    async def claim(self, batch_index: int) -> None:
        """Take back the slots lent to rollout; train only once they are free."""
        claim = SlotsClaim(trainer_id=self.trainer_id, batch_index=batch_index, policy=self.policy)
        granted = await self._ask(self.bus.subjects.sched_claim(), claim, SlotsGranted)
        if granted is not None and granted.missed:
            log.warning("engines %s did not release their slots in time", granted.missed)

    async def release(self, version: int, frees_memory: bool = False) -> list[str]:
        """Waiting for a batch, ``version`` published: the scheduler may lend my slots;
        the engines it lends. With ``frees_memory`` they serve only after ``freed``."""
        release = SlotsReleased(
            trainer_id=self.trainer_id,
            version=version,
            policy=self.policy,
            frees_memory=frees_memory,
        )
        report = await self._ask(self.bus.subjects.sched_release(), release, LendReport)
        if report is None or not report.lent:
            return []
        log.debug("slots lent to %s: %s", report.lent, report.reason)
        return report.lent

    async def freed(self, offloaded_bytes: int, seconds: float) -> None:
        """My state is off the device: the engines ``release`` named may serve now."""
        freed = SlotsFreed(
            trainer_id=self.trainer_id,
            policy=self.policy,
            offloaded_bytes=offloaded_bytes,
            seconds=seconds,
        )
        await self._ask(self.bus.subjects.sched_freed(), freed, LendReport)

    async def _ask(self, subject: str, request: Message, reply_type: type[R]) -> R | None:
        """A scheduler that does not answer never blocks training: logged, then None."""
        try:
            reply: R = await self.bus.request(subject, request, reply_type, timeout=self.timeout_s)
        except (NoResponder, RemoteError) as exc:
            log.warning("tag-scheduler did not answer on %s (%s); training goes on", subject, exc)
            return None
        return reply
