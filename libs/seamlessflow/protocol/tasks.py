"""Task claims: an agent runner asks the trajectory service for one sample of a task."""

from __future__ import annotations

from typing import Literal

import msgspec

from seamlessflow.protocol.base import DEFAULT_POLICY, Message


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str


class TaskClaim(Message, tag="task.claim"):
    """agent runner -> trajectory: give me one sample of a task to roll out."""

    runner_id: str
    claim_id: str = ""
    """Unique per claim. A runner that got no reply repeats the claim with the same id
    and gets the same assignment: a reply that was late or lost (the claim waited
    behind others, the service was slow under load) loses no sample. Empty: every
    request is a new claim."""


class TaskAssignment(Message, tag="task.assignment"):
    """trajectory -> agent runner: roll out sample ``sample_index`` of group ``group_id``."""

    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    messages: list[ChatMessage]
    reference: str
    reward_fn: str
    policy: str = DEFAULT_POLICY
    """The task's policy (the run's first): ``reward_fn`` scores its last answer."""
    min_version: int = 0
    """Serve this sample's calls to ``policy`` with weights of at least this version
    (0: any). Set in synchronous runs (``SF_MAX_BATCHES_AHEAD=0``) to the
    version the trainer last published, so no token of the batch is generated on the
    weights before it while an engine is still loading the new ones."""


class NoTask(Message, tag="task.none"):
    """trajectory -> agent runner: nothing to do now (backpressure) or ever (exhausted)."""

    reason: Literal["backpressure", "exhausted"]
    retry_after_s: float = 0.2
