"""Group time-outs: a group handed out to agents that stops making progress is closed.

A group can wait forever for a sample that will never finish: its session was open on
a gateway that restarted (sessions live in the gateway's memory), the agent runner
lost the gateway before it opened the session, or a claim's reply was lost with a
broker restart. Each such group would hold back a batch, and the rhythm (which counts
it as useful) would never hand out a replacement, so the run would stall.

Progress is anything that moves the group: a claim of one of its samples, or any event
of one of its sessions. A group without progress for ``timeout_s`` is closed by a
durable ``GroupClosed`` event, which the grouper applies like any other event (so a
restart replays the same decision): every sample of the group not finished is dropped
(``timed_out``) and the group closes with the samples it has, or counts as lost and is
refilled if it has none. No I/O and no clock here: the service passes the time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Waiting:
    group_id: str
    task_id: str
    group_size: int
    since: float
    """When the group last made progress."""


class GroupTimeouts:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waiting: dict[str, Waiting] = {}
        """Groups handed out and not complete, by id."""

    def progress(self, group_id: str, task_id: str, group_size: int, now: float) -> None:
        waiting = self.waiting.get(group_id)
        if waiting is None:
            self.waiting[group_id] = Waiting(group_id, task_id, group_size, now)
        else:
            waiting.since = now
            waiting.task_id = waiting.task_id or task_id

    def done(self, group_id: str) -> None:
        self.waiting.pop(group_id, None)

    def expired(self, now: float) -> list[Waiting]:
        """The groups without progress for ``timeout_s``; each is returned once (its
        close is then on its way)."""
        late = [w for w in self.waiting.values() if now - w.since > self.timeout_s]
        for waiting in late:
            del self.waiting[waiting.group_id]
        return late
