"""Lending in the other direction: which idle engines' cores a training trainer may use.

Pure, like :mod:`sf_tag_scheduler.policy`: :class:`~sf_tag_scheduler.cores.CoresLending`
feeds it the engines as their heartbeats show them and tells the trainer the answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sf_tag_scheduler.policy import ResourceView


@dataclass(frozen=True)
class EngineLoad:
    """An engine as its latest heartbeat shows it, for lending its cores to training."""

    view: ResourceView
    host: str
    phase: str
    in_flight: int
    alive: bool = True


def cores_for_training(trainer_host: str, engines: Sequence[EngineLoad]) -> tuple[str, ...]:
    """Lending in the other direction: the engines whose cores a training trainer may
    use now. A dedicated rollout engine on the trainer's host lends its cores while it
    has nothing to do: alive, in phase ``idle`` (not generating, not loading weights)
    and no request in flight. Its next request takes them back (its heartbeat on the
    phase change reaches the scheduler at once). Lendable engines are not in this: they
    sit on the trainer's own slots and are reclaimed while it trains. An unknown host
    lends nothing. Sorted by id."""
    if not trainer_host:
        return ()
    return tuple(
        sorted(
            engine.view.resource_id
            for engine in engines
            if engine.alive
            and engine.view.dedicated_rollout
            and engine.host == trainer_host
            and engine.phase == "idle"
            and engine.in_flight == 0
        )
    )


def lent_threads(engines: Sequence[EngineLoad], lent: Sequence[str]) -> int:
    """One thread per slot of each lending engine (an engine without slots: one)."""
    slots = {engine.view.resource_id: len(engine.view.slots) or 1 for engine in engines}
    return sum(slots.get(engine_id, 0) for engine_id in lent)
