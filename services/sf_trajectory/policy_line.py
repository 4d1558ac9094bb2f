"""One policy's side of the trajectory service: its grouper, batch indexes and how far
its trainer has come. A run of several policies has one line each (``SF_POLICIES``)."""

from __future__ import annotations

from dataclasses import dataclass

from seamlessflow.protocol import Subjects
from sf_trajectory.grouping import Grouper


@dataclass
class PolicyLine:
    """One policy's side of the trajectory service: its samples, groups and batches."""

    subjects: Subjects
    grouper: Grouper
    next_batch_index: int = 0
    """Index of the next batch this policy's trainer gets (= the version training it)."""
    trained_batches: int = 0
    """Batches the policy's trainer has consumed (from its metrics)."""
    published_version: int = 0
    """The weight version its trainer published last (from its metrics, which it sends
    once the version is stored): what a synchronous run's next samples are served on."""
    finished: bool = False
    """Its trainer reached its step budget (TrainingFinished): it no longer sets the pace."""
    progress_reported: tuple[int, int] = (0, 0)
    """The last BatchProgress published: (batch index, groups ready)."""
    planned_steps: int | None = None
    """The step budget its trainer announced last (TrainingPlanned); None: not yet."""

    @property
    def policy(self) -> str:
        return self.subjects.policy
