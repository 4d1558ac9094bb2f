"""The rollout rhythm: which task sample an agent runner gets next, and when to wait."""

from __future__ import annotations

import random

from seamlessflow.protocol import ChatMessage, NoTask, TaskAssignment
from seamlessflow.tasks import TaskItem


class Dispatcher:
    """Hands out task samples group by group, bounded by the trainer's progress.

    Invariant (staleness bound): group ``k`` is dispatched only when the trainer has
    consumed at least ``k // groups_per_batch - max_batches_ahead`` batches, so no sample
    is generated more than ``max_batches_ahead + 1`` weight versions before it is trained.
    """

    def __init__(
        self,
        items: list[TaskItem],
        *,
        reward_fn: str,
        group_size: int,
        groups_per_batch: int,
        total_batches: int,
        max_batches_ahead: int,
        seed: int,
        next_group: int = 0,
    ) -> None:
        if not items:
            raise ValueError("the task source has no items")
        self.items = items
        self.reward_fn = reward_fn
        self.group_size = group_size
        self.groups_per_batch = groups_per_batch
        self.total_groups = total_batches * groups_per_batch if total_batches > 0 else None
        self.max_batches_ahead = max_batches_ahead
        self.seed = seed
        self.next_group = next_group
        self.next_sample = 0
        self._epoch_orders: dict[int, list[int]] = {}

    def item_for_group(self, group: int) -> TaskItem:
        epoch, index = divmod(group, len(self.items))
        order = self._epoch_orders.get(epoch)
        if order is None:
            order = list(range(len(self.items)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._epoch_orders = {epoch: order}  # only the current epoch is needed
        return self.items[order[index]]

    def claim(self, trained_batches: int, groups_lost: int = 0) -> TaskAssignment | NoTask:
        """``groups_lost``: groups that will never reach a batch (every sample failed or
        was dropped as stale). Each is replaced by one more group, so a run with a step
        budget still fills its last batch instead of waiting forever."""
        useful = max(self.next_group - groups_lost, 0)
        if self.total_groups is not None and useful >= self.total_groups:
            return NoTask(reason="exhausted")
        batch_of_group = useful // self.groups_per_batch
        if batch_of_group > trained_batches + self.max_batches_ahead:
            return NoTask(reason="backpressure", retry_after_s=0.2)
        item = self.item_for_group(self.next_group)
        assignment = TaskAssignment(
            task_id=item.task_id,
            group_id=group_id(self.next_group),
            sample_index=self.next_sample,
            group_size=self.group_size,
            messages=[ChatMessage(role=m["role"], content=m["content"]) for m in item.messages],
            reference=item.reference,
            reward_fn=self.reward_fn,
        )
        self.next_sample += 1
        if self.next_sample == self.group_size:
            self.next_group += 1
            self.next_sample = 0
        return assignment


def group_id(index: int) -> str:
    return f"g{index:07d}"


def group_index(group_id_: str) -> int:
    """The dispatch index of a group id we made; -1 for groups made elsewhere (ad hoc)."""
    if len(group_id_) == 8 and group_id_[0] == "g" and group_id_[1:].isdigit():
        return int(group_id_[1:])
    return -1
