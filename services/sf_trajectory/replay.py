"""Recovery at start-up: the trajectory service's state rebuilt from what its streams hold.

Pure: the service reads the streams and feeds what they hold here; nothing here does
I/O, so recovery is tested on plain data (tests/unit/test_trajectory_replay.py).

- ``StoredLine`` -> ``restore_line``: one policy's line as its streams left it: the
  sessions in a published batch (never batched again: docs/architecture.md, invariant
  4), the drops already reported (not reported twice), how far its trainer came,
  whether it finished, and the step budget it announced.
- ``GroupReplay``: the trajectory stream's events, read again in order (the service
  applies each one through its usual path), say which groups were handed out; then
  ``resume_point`` is where dispatch goes on, and ``unopened_groups`` are the groups
  handed out that never opened a session (they wait for their time-out like any other).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

from seamlessflow.protocol import (
    BatchFilterReport,
    BatchReady,
    GroupClosed,
    SessionOpened,
    TrainBatch,
    TrainingPlanned,
    TrainStepMetrics,
    TrajectoryEvent,
)
from sf_trajectory.group_ids import group_id, group_index
from sf_trajectory.policy_line import PolicyLine


@dataclass(frozen=True)
class StoredLine:
    """What the streams hold for one policy, read once at start-up."""

    announcements: Sequence[BatchReady | TrainBatch] = ()
    """Its batch stream's announcements: the batches published."""
    batch_reports: Sequence[BatchFilterReport] = ()
    """Its published batch reports: what they counted as dropped."""
    train_metrics: Sequence[TrainStepMetrics] = ()
    """Its trainer's step metrics: the batches consumed, the versions published."""
    trainer_finished: bool = False
    """Its trainer stored a TrainingFinished."""
    plan: TrainingPlanned | None = None
    """The last step budget its trainer announced (None: none yet)."""


def restore_line(line: PolicyLine, stored: StoredLine) -> None:
    """Bring a fresh ``line`` to where its streams left it, before the trajectory
    stream's events are applied again."""
    grouper = line.grouper
    for batch in stored.announcements:
        for group in batch.groups:
            grouper.already_batched.update(s.session_id for s in group.samples)
            grouper.finished_groups.add(group.group_id)
            grouper.filters.observe(group)  # the event replay skips these sessions
        line.next_batch_index = max(line.next_batch_index, batch.batch_index + 1)
    for report in stored.batch_reports:
        for ids in (*report.dropped_samples.values(), *report.dropped_groups.values()):
            grouper.reported.update(ids)
    line.trained_batches = max((m.batch_index + 1 for m in stored.train_metrics), default=0)
    line.published_version = max((m.version for m in stored.train_metrics), default=0)
    # batch indices never repeat, even once retention dropped every batch: the trainer
    # skips a batch at or below the last one it trained
    line.next_batch_index = max(line.next_batch_index, line.trained_batches)
    line.finished = stored.trainer_finished
    if stored.plan is not None:
        line.planned_steps = stored.plan.steps


@dataclass
class GroupReplay:
    """The groups the replayed trajectory stream names, read in stream order."""

    events: int = 0
    """Stored messages read (those that did not decode too)."""
    max_group: int = -1
    """The highest dispatch index a session opened in or a close named (-1: none)."""
    min_group: int | None = None
    """The lowest group with an event still stored (retention drops the oldest)."""
    seen_groups: set[str] = field(default_factory=set)
    last_sample: dict[str, int] = field(default_factory=dict)
    """Group -> the highest sample index that opened a session."""

    def read(self, event: TrajectoryEvent | None) -> None:
        """The next stored message (None: it did not decode)."""
        self.events += 1
        if isinstance(event, SessionOpened | GroupClosed):
            index = group_index(event.group_id)
            self.max_group = max(self.max_group, index)
            if index >= 0:
                self.min_group = index if self.min_group is None else min(self.min_group, index)
            self.seen_groups.add(event.group_id)
        if isinstance(event, SessionOpened):
            self.last_sample[event.group_id] = max(
                self.last_sample.get(event.group_id, -1), event.sample_index
            )

    def resume_point(
        self, finished_groups: Iterable[str], open_groups: Container[str], group_size: int
    ) -> tuple[int, int]:
        """The (group, sample) dispatch goes on from, once every event is applied.

        ``finished_groups``: the groups the lines completed, closed or found in a stored
        batch; ``open_groups``: those still waiting for samples. Group ids never repeat:
        the batches still stored name groups whose events retention may have dropped.
        The last group may have been handed out in part when the service stopped: its
        remaining samples are handed out now (a claim answered before the stop has
        opened its session by the time the replay runs), instead of waiting for its
        time-out. A closed group is done.
        """
        batched_max = max((group_index(g) for g in finished_groups), default=-1)
        last = group_id(self.max_group)
        resumed = self.last_sample.get(last, -1) + 1
        if self.max_group > batched_max and 0 < resumed < group_size and last in open_groups:
            return self.max_group, resumed
        return max(self.max_group, batched_max) + 1, 0

    def unopened_groups(self) -> list[str]:
        """Groups below the last one seen were handed out; those that never opened a
        session (every claim's reply or session was lost). Groups below the first one
        stored are older than the stream's retention: done."""
        return [
            group_id(index)
            for index in range(self.min_group or 0, self.max_group + 1)
            if group_id(index) not in self.seen_groups
        ]
