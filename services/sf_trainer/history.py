"""What the run's streams say a policy's trainer already did: its newest step record and
its newest announced version. A (re)started trainer continues after both
(``TrainerService._resume``), whatever checkpoint it resumes the policy from."""

from __future__ import annotations

from seamlessflow.bus import Bus
from seamlessflow.protocol import TrainStepMetrics, WeightsPublished


async def last_recorded_step(bus: Bus) -> TrainStepMetrics | None:
    """The policy's newest step record in the metrics stream (None: no step yet)."""
    subjects = bus.subjects
    recorded = await bus.read_decoded(
        subjects.stream_metrics(), subjects.train_metrics(), TrainStepMetrics
    )
    return max(recorded, key=lambda m: (m.step, m.version), default=None)


async def announced_version(bus: Bus) -> int:
    """The newest version in the weights stream (0: none). The stream, not
    weight-sync's ``weights.current``: it holds every announcement, also those
    weight-sync has not processed (or when it is down)."""
    subjects = bus.subjects
    announced = await bus.read_decoded(
        subjects.stream_weights(), subjects.weights_published(), WeightsPublished
    )
    return max((w.version for w in announced), default=0)
