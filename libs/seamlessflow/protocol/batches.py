"""Training batches and the data filters' reports: trajectory -> trainer and observers.

A batch is groups of samples (token ids exactly as the engine saw them). Its payload is
stored in chunks first, then announced by ``BatchReady``; ``BatchProgress`` hints the
tag-scheduler while a batch forms; the filter reports record what was kept and dropped.
"""

from __future__ import annotations

import time

import msgspec

from seamlessflow.protocol.base import DEFAULT_POLICY, Message


class TrainSample(msgspec.Struct, kw_only=True):
    """One trajectory as the trainer sees it: token ids exactly as the engine saw them.

    ``loss_mask[i] == 1`` iff token i was produced by the engine (trained on);
    ``behaviour_logprobs[i]``, ``versions[i]`` and ``temperatures[i]`` are meaningful only
    where the mask is 1 (0.0, -1 and 1.0 elsewhere).
    """

    session_id: str
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    versions: list[int]
    reward: float
    temperatures: list[float] = msgspec.field(default_factory=list)
    """The temperature each token was sampled at (its turn's ``TurnRecorded.temperature``,
    0 = greedy), at which the trainer recomputes its logprob; ``UNRECORDED_TEMPERATURE``
    for a turn recorded without one. Empty: a sample made before samples carried
    temperatures (every token unrecorded)."""
    finish_reason: str = ""
    """Why the sample's last generation (the turn it ends at) ended:
    ``TurnRecorded.finish_reason`` (``stop``, or ``length`` when it reached its token
    budget). "": a sample made before samples carried it."""


class SampleGroup(msgspec.Struct, kw_only=True):
    """All samples of one task (a GRPO group)."""

    group_id: str
    task_id: str
    samples: list[TrainSample]


class TrainBatch(Message, tag="batch"):
    """trajectory -> trainer: one optimizer step's worth. Travels as the payload a
    BatchReady names (``seamlessflow.batches``); a trainer also takes one published
    whole on the batch subject (a small batch, as published before payloads existed)."""

    batch_index: int
    groups: list[SampleGroup]
    policy: str = DEFAULT_POLICY
    """The policy this batch trains (each policy has its own batch stream and indexes)."""
    created_at: float = msgspec.field(default_factory=time.time)


class SampleSummary(msgspec.Struct, array_like=True):
    """A sample of a batch, without its tokens."""

    session_id: str
    reward: float
    tokens: int


class GroupSummary(msgspec.Struct, kw_only=True):
    """A group of a batch, without its samples' tokens."""

    group_id: str
    task_id: str
    samples: list[SampleSummary]


class BatchPayload(msgspec.Struct, kw_only=True):
    """Where a batch's encoded ``TrainBatch`` is: chunk messages of the policy's batch
    payload stream, by stream sequence, in order."""

    encoding: str
    """``packed-msgpack-1`` (``seamlessflow.batches``)."""
    chunk_seqs: list[int]
    payload_bytes: int
    sha256: str


class BatchReady(Message, tag="batch.ready"):
    """trajectory -> trainer (JetStream, durable consumer): batch ``batch_index`` is
    complete in its payload stream (stored before this message exists). ``groups``
    names its groups and sessions: what a restarted trajectory service reads back,
    without the payloads."""

    batch_index: int
    groups: list[GroupSummary]
    payload: BatchPayload
    policy: str = DEFAULT_POLICY
    created_at: float = msgspec.field(default_factory=time.time)


class BatchProgress(Message, tag="batch.progress"):
    """trajectory -> tag-scheduler (core NATS): another group of the batch being formed
    is ready. A hint for the early reclaim (``SF_TAG_SCHEDULER_RECLAIM_EARLY_AT``): one
    that is lost only means the lent engines are taken back at the trainer's claim."""

    batch_index: int
    groups_ready: int
    groups_per_batch: int
    policy: str = DEFAULT_POLICY


class BatchFilterReport(Message, tag="data.batch"):
    """trajectory -> itself after a restart, and whoever reads the run's metrics stream
    (JetStream): what the data filters did while batch ``batch_index`` was formed,
    counted from the previous batch on."""

    batch_index: int
    stage: str
    """The task source of the schedule stage this batch belongs to."""
    groups_kept: int
    samples_kept: int
    policy: str = DEFAULT_POLICY
    groups_dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Groups that never reach a batch, by reason (``zero_variance``, ``stale``,
    ``no_samples``); the dispatcher hands out one more group for each (a refill)."""
    samples_dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Samples left out, by reason (``stale``, ``zero_variance``, ``no_turns``,
    ``timed_out``...)."""
    groups_waived: dict[str, int] = msgspec.field(default_factory=dict)
    """Groups a filter would have dropped but let through, by reason
    (``zero_variance``: the refill cap of the batch was reached)."""
    dropped_samples: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """The samples counted in ``samples_dropped``, by reason: session ids, or
    ``<group_id>/<sample_index>`` for a sample whose session never opened. Each dropped
    sample is reported once, also across restarts of the trajectory service."""
    dropped_groups: dict[str, list[str]] = msgspec.field(default_factory=dict)
    """The groups counted in ``groups_dropped``, by reason (reported once, likewise)."""
    tool_call_errors: dict[str, int] = msgspec.field(default_factory=dict)
    """Tool calls the model wrote malformed, by kind (``TurnRecorded.tool_call_errors``):
    those of the sessions trained in this batch, and of the sessions and groups this
    report counts as dropped."""


class EpochFilterReport(Message, tag="data.epoch"):
    """trajectory -> itself after a restart, and whoever reads the run's metrics stream
    (JetStream): the prompt set an epoch dispatches. Recorded before the epoch's first
    group is handed out; a restarted trajectory service rebuilds every epoch's prompt
    order from these records."""

    stage: str
    stage_index: int
    epoch: int
    """Epoch number within the stage, from 0."""
    first_group: int
    """Dispatch index of the epoch's first group."""
    prompts: int
    """Prompts this epoch dispatches (one group each)."""
    kept: dict[str, int] = msgspec.field(default_factory=dict)
    """Prompts of the previous epoch that stay, by why (``mixed``, ``all_wrong``,
    ``unseen``: no complete group yet); empty for epoch 0."""
    dropped: dict[str, int] = msgspec.field(default_factory=dict)
    """Prompts of the previous epoch left out from now on, by reason (``all_correct``)."""
    dropped_task_ids: list[str] = msgspec.field(default_factory=list)
    kept_all: bool = False
    """Every prompt would have been dropped: the previous epoch's set was kept instead."""
