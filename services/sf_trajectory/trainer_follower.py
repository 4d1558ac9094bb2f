"""Each policy's trainer as its broadcasts tell: the batches it consumed and the version
it published (TrainStepMetrics), its step budget (TrainingPlanned) and its finish
(TrainingFinished), kept on the policy's line; what the rollout rhythm follows.

One seed for the run: a trainer that announces another seed than this service's ends
the run with one line (``check_plan`` at start-up, ``watch`` after).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping

from seamlessflow.bus import Bus, Unrecoverable
from seamlessflow.protocol import TrainingFinished, TrainingPlanned, TrainStepMetrics
from sf_trajectory.policy_line import PolicyLine

log = logging.getLogger(__name__)


class TrainerFollower:
    """Follows the trainers of ``lines`` (read in place: the service adds its lines)."""

    def __init__(self, lines: Mapping[str, PolicyLine], seed: int) -> None:
        self.lines = lines
        self.seed = seed
        self.on_budget: Callable[[int], None] = lambda budget: None
        """Told the new step budget each time a trainer announces its plan."""
        self._error: Unrecoverable | None = None
        self._failed = asyncio.Event()

    async def subscribe(self, bus: Bus) -> None:
        """Follow every line's trainer from now on."""
        for line in self.lines.values():
            await bus.subscribe(
                line.subjects.train_metrics(), TrainStepMetrics, self._train_metrics_handler(line)
            )
            await bus.subscribe(
                line.subjects.train_finished(),
                TrainingFinished,
                self._train_finished_handler(line),
            )
            await bus.subscribe(
                line.subjects.train_plan(), TrainingPlanned, self._train_plan_handler(line)
            )

    def check_plan(self, plan: TrainingPlanned) -> None:
        """One seed for the run: the task order here, the trainer's evaluation split."""
        if plan.seed != self.seed:
            raise Unrecoverable(
                f"the trainer of {plan.policy} runs with SF_SEED={plan.seed} but this "
                f"trajectory service has SF_SEED={self.seed}: start every service "
                "of a run with the same SF_SEED"
            )

    def step_budget(self) -> int:
        """Batches to dispatch for: the largest budget the trainers announced (tasks are
        shared by the policies), once every policy's trainer announced one; 0 until then
        (the pacing alone bounds the dispatch)."""
        planned = [line.planned_steps for line in self.lines.values()]
        if any(steps is None for steps in planned):
            return 0
        return max(steps for steps in planned if steps is not None)

    def _train_plan_handler(self, line: PolicyLine) -> Callable[[TrainingPlanned], Awaitable[None]]:
        async def on_train_plan(plan: TrainingPlanned) -> None:
            try:
                self.check_plan(plan)
            except Unrecoverable as exc:
                self._error = exc
                self._failed.set()
                return
            line.planned_steps = plan.steps
            self.on_budget(self.step_budget())
            log.info("the trainer of %s plans %d steps", line.policy, plan.steps)

        return on_train_plan

    async def watch(self) -> None:
        """A trainer announced another seed after start: end the run with that line."""
        await self._failed.wait()
        assert self._error is not None
        raise self._error

    def _train_metrics_handler(
        self, line: PolicyLine
    ) -> Callable[[TrainStepMetrics], Awaitable[None]]:
        async def on_train_metrics(metrics: TrainStepMetrics) -> None:
            line.trained_batches = max(line.trained_batches, metrics.batch_index + 1)
            line.published_version = max(line.published_version, metrics.version)

        return on_train_metrics

    def _train_finished_handler(
        self, line: PolicyLine
    ) -> Callable[[TrainingFinished], Awaitable[None]]:
        async def on_train_finished(_: TrainingFinished) -> None:
            line.finished = True
            log.info("the trainer of %s finished: it no longer sets the pace", line.policy)

        return on_train_finished
