"""Lending cores to training: ``sched.cores.<trainer>`` (CoresLent, core).

With ``SF_TAG_SCHEDULER_LEND_CORES_TO_TRAINING``, while a trainer trains (claim to
release), it is told the cores of the dedicated rollout engines on its host that have
nothing to do (``idle_cores.cores_for_training``); told again on every change, and 0 threads
when the engines take them back or the trainer stops training. It owns which trainer of
each policy is training, and which engines' cores that trainer was last told of.
"""

from __future__ import annotations

from seamlessflow import telemetry
from seamlessflow.bus import Bus
from seamlessflow.protocol import CoresLent
from sf_tag_scheduler.idle_cores import cores_for_training, lent_threads
from sf_tag_scheduler.registry import ResourceRegistry

tracer = telemetry.tracer(__name__)


class CoresLending:
    """Tells each policy's training trainer, over ``bus``, which idle engines' cores it
    may use (``enabled``: ``lend_cores_to_training``)."""

    def __init__(self, bus: Bus, registry: ResourceRegistry, *, enabled: bool) -> None:
        self.bus = bus
        self.registry = registry
        self.enabled = enabled
        self.training: dict[str, str] = {}
        """Per policy, the trainer that claimed its slots and has not released them."""
        self.cores_lent: dict[str, tuple[str, ...]] = {}
        """Per policy, the engines whose cores its trainer was last told it may use."""

    async def start_training(self, policy: str, trainer_id: str) -> None:
        """``trainer_id`` claimed the slots of ``policy``: it trains until it releases."""
        self.training[policy] = trainer_id
        await self.update(policy)

    async def stop_training(self, policy: str) -> None:
        """The trainer of ``policy`` released its slots: 0 threads from now."""
        await self.update(policy, released=True)

    async def update(self, policy: str, released: bool = False) -> None:
        """Tell the training trainer of ``policy`` which idle engines' cores it may use,
        if that changed (an engine's load or phase changed, one joined or died).
        ``released``: it stops training (0 threads from now)."""
        trainer_id = self.training.pop(policy, None) if released else self.training.get(policy)
        if trainer_id is None or not self.enabled:
            return
        engines = self.registry.engine_loads(policy)
        lent: tuple[str, ...] = ()
        if not released:
            trainer = self.registry.resources.get(trainer_id)
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
            await self.bus.publish(
                self.bus.subjects.sched_cores(trainer_id),
                CoresLent(
                    trainer_id=trainer_id, threads=threads, engines=list(lent), policy=policy
                ),
            )
