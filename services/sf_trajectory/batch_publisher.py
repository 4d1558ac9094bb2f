"""A policy's batches going out: each batch its grouper has ready is published with the
report of what the data filters did while it formed, then the progress of the next one.

Invariant: a batch's index is its line's ``next_batch_index``, which only grows, and its
sessions join ``already_batched`` once it is stored (never batched twice:
docs/architecture.md, invariant 4). The batch report's message id names the policy and
the index, so a re-publish after a restart lands once.
"""

from __future__ import annotations

import logging

from seamlessflow import telemetry
from seamlessflow.batches import publish_batch
from seamlessflow.bus import Bus
from seamlessflow.protocol import BatchFilterReport, BatchProgress, MessageIds, TrainBatch
from sf_trajectory.policy_line import PolicyLine
from sf_trajectory.schedule import Stage, stage_of_batch

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class BatchPublisher:
    """Publishes the policy lines' batches, reports and progress on ``bus``."""

    def __init__(self, bus: Bus, stages: list[Stage], groups_per_batch: int) -> None:
        self.bus = bus
        self.stages = stages
        self.groups_per_batch = groups_per_batch

    async def publish_ready(self, line: PolicyLine) -> None:
        """Every batch the line's grouper has ready, each with its report, then the
        progress of the batch being formed if it changed."""
        grouper = line.grouper
        while (
            groups := grouper.take_batch(self.groups_per_batch, batch_index=line.next_batch_index)
        ) is not None:
            batch = TrainBatch(batch_index=line.next_batch_index, groups=groups, policy=line.policy)
            await self._publish(line, batch)
            for group in groups:
                grouper.already_batched.update(s.session_id for s in group.samples)
            line.next_batch_index += 1
        progress = (line.next_batch_index, grouper.judged)
        if grouper.judged and progress != line.progress_reported:
            line.progress_reported = progress
            await self.bus.publish(
                line.subjects.batch_progress(),
                BatchProgress(
                    batch_index=line.next_batch_index,
                    groups_ready=grouper.judged,
                    groups_per_batch=self.groups_per_batch,
                    policy=line.policy,
                ),
            )

    async def _publish(self, line: PolicyLine, batch: TrainBatch) -> None:
        """The batch, then what the data filters did while it formed."""
        report = self._report(line, batch)
        with tracer.start_as_current_span(
            "trajectory.batch",
            attributes={
                "policy": line.policy,
                "batch.index": batch.batch_index,
                "stage": report.stage,
                "batch.samples": report.samples_kept,
                **prefixed("batch.groups_dropped", report.groups_dropped),
                **prefixed("batch.samples_dropped", report.samples_dropped),
                **prefixed("batch.groups_waived", report.groups_waived),
                **prefixed("batch.tool_call_errors", report.tool_call_errors),
            },
        ):
            await publish_batch(self.bus, batch)
            # the metrics stream holds every policy's reports: the id names the policy
            await self.bus.js_publish(
                line.subjects.data_batch_report(),
                report,
                msg_id=MessageIds.data_batch_report(line.policy, batch.batch_index),
            )
        if (
            report.groups_dropped or report.groups_waived or report.samples_dropped
            or report.tool_call_errors
        ):  # fmt: skip
            log.info(
                "%s batch %d (%s): %d groups; groups dropped %s, waived %s; samples dropped "
                "%s; malformed tool calls %s",
                line.policy, batch.batch_index, report.stage, report.groups_kept,
                report.groups_dropped or "-", report.groups_waived or "-",
                report.samples_dropped or "-", report.tool_call_errors or "-",
            )  # fmt: skip

    def _report(self, line: PolicyLine, batch: TrainBatch) -> BatchFilterReport:
        tally = line.grouper.last_tally
        stage = self.stages[stage_of_batch(self.stages, batch.batch_index)]
        return BatchFilterReport(
            batch_index=batch.batch_index,
            stage=stage.name,
            policy=line.policy,
            groups_kept=len(batch.groups),
            samples_kept=sum(len(g.samples) for g in batch.groups),
            groups_dropped=dict(tally.groups_dropped),
            samples_dropped=dict(tally.samples_dropped),
            groups_waived=dict(tally.groups_waived),
            dropped_samples=dict(tally.dropped_samples),
            dropped_groups=dict(tally.dropped_groups),
            tool_call_errors=dict(tally.tool_call_errors),
        )


def prefixed(prefix: str, counts: dict[str, int]) -> dict[str, int]:
    """Span attributes ``<prefix>.<reason>`` for a count by reason."""
    return {f"{prefix}.{reason}": count for reason, count in counts.items()}
