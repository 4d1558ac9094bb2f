"""The rollout rhythm: which task sample an agent runner gets next, and when to wait.

Groups get consecutive dispatch indices (group ids ``g0000000``, ``g0000001``...:
``group_ids``).

**Epochs.** An epoch is one pass over a stage's current prompt set in a fresh
permutation: epoch ``e`` of a stage is the run of dispatch indices that starts at its
``first_group`` and has one group per prompt of the set (seeded by ``seed`` and ``e``, so
the order is reproducible). The epoch boundary is the moment the dispatcher hands out the
first group after that run: the prompt-set filters (``history_resampling``) then choose
the next epoch's set from the ending one, using the groups complete at that moment (a
group still in flight counts at the next boundary). Epoch 0 of a stage holds every
prompt of its task source. A stage switch ends the stage's last epoch early.

**Records.** Each epoch is recorded (``EpochFilterReport``, durable) before any of its
groups reaches an agent; a restarted service rebuilds every epoch's order from the
records, so a group index maps to the same prompt before and after a restart.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from seamlessflow.protocol import (
    DEFAULT_POLICY,
    ChatMessage,
    EpochFilterReport,
    NoTask,
    TaskAssignment,
)
from sf_trajectory.group_ids import group_id
from sf_trajectory.schedule import Stage, stage_of_batch

if TYPE_CHECKING:
    from sf_trajectory.data_filters import DataFilters

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Epoch:
    stage: int
    number: int
    first_group: int
    order: tuple[int, ...]
    """Indices into the stage's items, in dispatch order."""

    def holds(self, group: int) -> bool:
        return self.first_group <= group < self.first_group + len(self.order)


class Dispatcher:
    """Hands out task samples group by group, bounded by the trainer's progress.

    Invariant (staleness bound): counting only *useful* groups (dispatched minus lost:
    dropped by a group filter or with every sample failed), useful group ``k`` is
    dispatched only when the trainer has consumed at least
    ``k // groups_per_batch - max_batches_ahead`` batches, so no sample is generated more
    than ``max_batches_ahead + 1`` weight versions before it is trained. A refill (the
    replacement of a lost group) therefore never runs ahead of the rhythm.

    Invariant (stage switch): the first group of stage ``s`` is dispatched only once
    every batch of the stages before it is published. Useful groups never exceed the
    batches they are meant for, so at that moment no earlier-stage group is in flight:
    batch ``stages[s].first_batch`` is the first with stage-``s`` prompts only.
    """

    def __init__(
        self,
        stages: list[Stage],
        *,
        group_size: int,
        groups_per_batch: int,
        total_batches: int,
        max_batches_ahead: int,
        seed: int,
        next_group: int = 0,
        next_sample: int = 0,
        data_filters: DataFilters | None = None,
        recorded_epochs: Sequence[EpochFilterReport] = (),
        task_policy: str = DEFAULT_POLICY,
    ) -> None:
        if not stages:
            raise ValueError("the schedule has no stages")
        self.stages = stages
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.total_groups: int | None = None
        self.set_total_batches(total_batches)
        self.max_batches_ahead = max_batches_ahead
        self.seed = seed
        self.task_policy = task_policy
        """The policy whose answers a task's reward function scores (the run's first)."""
        self.next_group = next_group
        self.next_sample = next_sample
        """The next sample index of ``next_group`` (a restart may resume mid-group)."""
        self.data_filters = data_filters
        self.epochs: list[Epoch] = []
        self.unrecorded_epochs: list[EpochFilterReport] = []
        """Epochs opened by claims whose record is not yet durable (the service publishes
        them before it answers the claim)."""
        for report in sorted(recorded_epochs, key=lambda r: r.first_group):
            self._restore_epoch(report)

    def set_total_batches(self, total_batches: int) -> None:
        """The step budget to dispatch for (0 = none yet: only the pacing bounds it)."""
        self.total_groups = total_batches * self.groups_per_batch if total_batches > 0 else None

    def claim(
        self, trained_batches: int, groups_lost: int = 0, batches_published: int = 0
    ) -> TaskAssignment | NoTask:
        """``groups_lost``: groups that will never reach a batch. Each is replaced by one
        more group, so a run with a step budget still fills its last batch instead of
        waiting forever. ``batches_published``: batches formed so far (stage switch).

        Every group is handed out: the runner is told ``exhausted`` (and stops) only
        once the last batch is published. Until then a group in flight may still be
        lost (failed samples, a time-out) and need a refill."""
        useful = max(self.next_group - groups_lost, 0)
        if self.total_groups is not None and useful >= self.total_groups:
            if batches_published * self.groups_per_batch >= self.total_groups:
                return NoTask(reason="exhausted")
            return NoTask(reason="backpressure", retry_after_s=0.5)
        batch_of_group = useful // self.groups_per_batch
        if batch_of_group > trained_batches + self.max_batches_ahead:
            return NoTask(reason="backpressure", retry_after_s=0.2)
        epoch = self._epoch_of_next_group(
            stage_of_batch(self.stages, batch_of_group), batches_published
        )
        if epoch is None:
            return NoTask(reason="backpressure", retry_after_s=0.2)  # the stage switch waits
        return self._assign(epoch)

    def _assign(self, epoch: Epoch) -> TaskAssignment:
        stage = self.stages[epoch.stage]
        item = stage.items[epoch.order[self.next_group - epoch.first_group]]
        assignment = TaskAssignment(
            task_id=item.task_id,
            group_id=group_id(self.next_group),
            sample_index=self.next_sample,
            group_size=self.group_size,
            messages=[ChatMessage(role=m["role"], content=m["content"]) for m in item.messages],
            reference=item.reference,
            reward_fn=stage.reward_fn_of(item),
            policy=self.task_policy,
        )
        self.next_sample += 1
        if self.next_sample == self.group_size:
            self.next_group += 1
            self.next_sample = 0
        return assignment

    def _epoch_of_next_group(self, stage: int, batches_published: int) -> Epoch | None:
        """The epoch of group ``next_group``; opens the next epoch, or the first epoch of
        ``stage`` when the group is meant for a later stage's batch. None while that
        switch waits for the earlier stages' last batch."""
        last = self.epochs[-1] if self.epochs else None
        if last is not None and self.next_group < last.first_group:
            # re-dispatching groups claimed but never opened before a restart
            return next(e for e in reversed(self.epochs) if e.first_group <= self.next_group)
        if last is None or stage > last.stage:
            if batches_published < self.stages[stage].first_batch:
                return None
            return self._open_epoch(stage, 0, range(len(self.stages[stage].items)))
        if last.holds(self.next_group):
            return last  # (a stage never goes back: its batches are all published)
        return self._open_next_epoch(last)

    def _open_next_epoch(self, ending: Epoch) -> Epoch:
        stage = self.stages[ending.stage]
        prompts = sorted(ending.order)
        kept_reasons: dict[str, int] = {}
        dropped: dict[str, list[str]] = {}
        if self.data_filters is not None:
            selection = self.data_filters.select(
                [stage.items[i] for i in prompts], since_group=self._stage_start(ending.stage)
            )
            kept_reasons, dropped = dict(selection.kept_reasons), selection.dropped
        dropped_ids = {task_id for ids in dropped.values() for task_id in ids}
        kept = [i for i in prompts if stage.items[i].task_id not in dropped_ids]
        kept_all = bool(dropped_ids) and not kept
        if kept_all:
            log.warning(
                "stage %s epoch %d: every prompt would be dropped (%s); keeping all %d",
                stage.name, ending.number + 1, _counts(dropped), len(prompts),
            )  # fmt: skip
            kept, dropped = prompts, {}
        return self._open_epoch(
            ending.stage, ending.number + 1, kept, kept_reasons, dropped, kept_all=kept_all
        )

    def _open_epoch(
        self,
        stage: int,
        number: int,
        prompts: Sequence[int],
        kept_reasons: dict[str, int] | None = None,
        dropped: dict[str, list[str]] | None = None,
        *,
        kept_all: bool = False,
    ) -> Epoch:
        epoch = self._make_epoch(stage, number, self.next_group, prompts)
        self.epochs.append(epoch)
        dropped = dropped or {}
        self.unrecorded_epochs.append(
            EpochFilterReport(
                stage=self.stages[stage].name,
                stage_index=stage,
                epoch=number,
                first_group=epoch.first_group,
                prompts=len(epoch.order),
                kept=kept_reasons or {},
                dropped=_counts(dropped),
                dropped_task_ids=[task_id for ids in dropped.values() for task_id in ids],
                kept_all=kept_all,
            )
        )
        return epoch

    def _make_epoch(
        self, stage: int, number: int, first_group: int, prompts: Sequence[int]
    ) -> Epoch:
        order = list(prompts)
        random.Random(self.seed * 1_000_003 + number).shuffle(order)
        return Epoch(stage=stage, number=number, first_group=first_group, order=tuple(order))

    def _stage_start(self, stage: int) -> int:
        return next(e.first_group for e in self.epochs if e.stage == stage)

    def _restore_epoch(self, report: EpochFilterReport) -> None:
        """Rebuild one recorded epoch: epoch 0 holds the stage's every prompt, epoch
        ``e`` the prompts of ``e - 1`` minus those the record says were dropped."""
        stage = report.stage_index
        if stage >= len(self.stages) or self.stages[stage].name != report.stage:
            raise ValueError(
                f"the run recorded stage {stage} as {report.stage!r}; the configured "
                f"schedule differs ({', '.join(s.name for s in self.stages)})"
            )
        if report.epoch == 0:
            prompts: list[int] = list(range(len(self.stages[stage].items)))
        else:
            previous = self.epochs[-1] if self.epochs else None
            if previous is None or (previous.stage, previous.number) != (stage, report.epoch - 1):
                raise ValueError(
                    f"the run's epoch records skip before {report.stage} {report.epoch}"
                )
            dropped = set(report.dropped_task_ids)
            items = self.stages[stage].items
            prompts = [i for i in sorted(previous.order) if items[i].task_id not in dropped]
        self.epochs.append(self._make_epoch(stage, report.epoch, report.first_group, prompts))


def _counts(by_reason: dict[str, list[str]]) -> dict[str, int]:
    return {reason: len(ids) for reason, ids in by_reason.items()}
