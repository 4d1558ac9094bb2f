"""Pure logic of the trajectory service: sessions -> samples -> groups -> batches.

No I/O here, so it is tested directly and rebuilt deterministically by replaying the
trajectory stream after a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from seamlessflow.protocol import (
    ExportedSample,
    RewardReported,
    SampleGroup,
    SessionExport,
    SessionFinished,
    SessionOpened,
    TrainSample,
    TrajectoryEvent,
    TurnRecorded,
)

log = logging.getLogger(__name__)

RewardLookup = Callable[[str], Callable[[str, str], float]]


@dataclass
class Session:
    opened: SessionOpened
    turns: list[TurnRecorded] = field(default_factory=list)
    reported_reward: float | None = None
    finished: bool = False


def branch(turns: list[TurnRecorded], leaf: TurnRecorded) -> tuple[TrainSample, list[int]]:
    """The token sequence ending at ``leaf``, with every turn on it masked in.

    The sequence is the leaf's prompt + completion. A turn whose prompt and completion lie
    on that sequence (same ids at the same positions) contributes its completion tokens to
    the loss mask; a turn from another branch does not. Every masked-in token is one the
    engine produced (invariant 1), with the logprob and version it was produced with.
    """
    token_ids = [*leaf.prompt_ids, *leaf.completion_ids]
    loss_mask = [0] * len(token_ids)
    logprobs = [0.0] * len(token_ids)
    versions = [-1] * len(token_ids)
    on_path = []
    for turn in turns:
        start = len(turn.prompt_ids)
        end = start + len(turn.completion_ids)
        if token_ids[:start] != turn.prompt_ids or token_ids[start:end] != turn.completion_ids:
            continue
        on_path.append(turn.turn_index)
        loss_mask[start:end] = [1] * (end - start)
        logprobs[start:end] = turn.logprobs
        versions[start:end] = turn.versions
    sample = TrainSample(
        session_id=leaf.session_id,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=logprobs,
        versions=versions,
        reward=0.0,
    )
    return sample, on_path


def leaves(turns: list[TurnRecorded]) -> list[TurnRecorded]:
    """Turns that no later turn extends: one per branch of the conversation tree."""
    result = []
    for i, turn in enumerate(turns):
        sequence = [*turn.prompt_ids, *turn.completion_ids]
        extended = any(later.prompt_ids[: len(sequence)] == sequence for later in turns[i + 1 :])
        if not extended:
            result.append(turn)
    return result


def build_sample(session: Session, reward: float) -> TrainSample | None:
    """The trajectory ending at the session's last turn (see ``branch``)."""
    if not session.turns:
        return None
    sample, _ = branch(session.turns, session.turns[-1])
    sample.reward = reward
    return sample


def session_reward(session: Session, reward_lookup: RewardLookup) -> float | None:
    """A reward the agent reported wins; else the task's verifier on the last answer."""
    if session.reported_reward is not None:
        return session.reported_reward
    if not session.turns or not session.opened.reward_fn:
        return None
    reward_fn = reward_lookup(session.opened.reward_fn)
    return float(reward_fn(session.turns[-1].completion_text, session.opened.reference))


def export_session(events: list[TrajectoryEvent], reward_lookup: RewardLookup) -> SessionExport:
    """Every branch of one session's conversation tree, from its stored events."""
    opened = next((e for e in events if isinstance(e, SessionOpened)), None)
    if opened is None:
        raise ValueError("the events hold no SessionOpened")
    session = Session(opened=opened)
    for event in events:
        if isinstance(event, TurnRecorded):
            session.turns.append(event)
        elif isinstance(event, RewardReported):
            session.reported_reward = event.reward
        elif isinstance(event, SessionFinished):
            session.finished = True
    reward = session_reward(session, reward_lookup) if session.finished else None
    samples = []
    for leaf in leaves(session.turns):
        sample, on_path = branch(session.turns, leaf)
        final = leaf is session.turns[-1]
        samples.append(
            ExportedSample(
                token_ids=sample.token_ids,
                loss_mask=sample.loss_mask,
                behaviour_logprobs=sample.behaviour_logprobs,
                versions=sample.versions,
                turn_indexes=on_path,
                final=final,
                reward=reward if final else None,
            )
        )
    return SessionExport(
        session_id=opened.session_id,
        task_id=opened.task_id,
        finished=session.finished,
        samples=samples,
    )


@dataclass
class Group:
    group_id: str
    task_id: str
    size: int
    samples: list[TrainSample] = field(default_factory=list)
    failed: int = 0

    @property
    def complete(self) -> bool:
        return len(self.samples) + self.failed >= self.size


class Grouper:
    """Folds trajectory events into complete groups, in completion order.

    ``already_batched`` holds the session ids that are in a published batch already:
    replaying the event stream after a restart skips them, so no trajectory is batched
    twice (invariant 4).
    """

    def __init__(self, reward_lookup: RewardLookup, already_batched: set[str] | None = None):
        self.reward_lookup = reward_lookup
        self.already_batched = already_batched or set()
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, Group] = {}
        self.ready: list[SampleGroup] = []
        self.dropped: dict[str, int] = {}
        self.stale_sessions: list[str] = []
        """Sessions dropped for staleness (accounted for: never trained, never lost)."""
        self.groups_lost = 0
        """Groups that will never be in a batch: all samples failed or went stale."""

    def apply(self, event: TrajectoryEvent) -> None:
        if isinstance(event, SessionOpened):
            if event.session_id in self.already_batched:
                return
            self.sessions[event.session_id] = Session(opened=event)
            self.groups.setdefault(
                event.group_id, Group(event.group_id, event.task_id, event.group_size)
            )
            return
        session = self.sessions.get(event.session_id)
        if session is None or session.finished:
            return  # batched before a restart, or an event after finish: nothing to do
        if isinstance(event, TurnRecorded):
            session.turns.append(event)
        elif isinstance(event, RewardReported):
            session.reported_reward = event.reward
        elif isinstance(event, SessionFinished):
            session.finished = True
            self._finish(session)

    def _finish(self, session: Session) -> None:
        opened = session.opened
        group = self.groups[opened.group_id]
        reward = self._reward(session)
        sample = build_sample(session, reward) if reward is not None else None
        if sample is None:
            group.failed += 1
            reason = "no_turns" if not session.turns else "no_reward"
            self.dropped[reason] = self.dropped.get(reason, 0) + 1
        else:
            group.samples.append(sample)
        del self.sessions[opened.session_id]
        if group.complete:
            del self.groups[group.group_id]
            if not group.samples:
                self.groups_lost += 1
            else:
                self.ready.append(
                    SampleGroup(
                        group_id=group.group_id, task_id=group.task_id, samples=group.samples
                    )
                )

    def _reward(self, session: Session) -> float | None:
        return session_reward(session, self.reward_lookup)

    def take_batch(
        self, groups_per_batch: int, *, batch_index: int = 0, max_staleness: int | None = None
    ) -> list[SampleGroup] | None:
        """The next batch, or None until enough groups are ready.

        Batch ``batch_index`` is trained by policy version ``batch_index``; a sample with a
        token generated more than ``max_staleness`` versions earlier is dropped (reason
        ``stale``), and a group left empty is dropped with it. Stale groups do not count
        towards the batch, so the batch is refilled from later groups.
        """
        while len(self.ready) >= groups_per_batch:
            candidate, rest = self.ready[:groups_per_batch], self.ready[groups_per_batch:]
            fresh = [
                g
                for g in (self._drop_stale(g, batch_index, max_staleness) for g in candidate)
                if g is not None
            ]
            if len(fresh) == groups_per_batch:
                self.ready = rest
                return fresh
            self.ready = fresh + rest
        return None

    def _drop_stale(
        self, group: SampleGroup, batch_index: int, max_staleness: int | None
    ) -> SampleGroup | None:
        if max_staleness is None:
            return group
        kept = []
        for sample in group.samples:
            produced = [v for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m]
            if produced and batch_index - min(produced) > max_staleness:
                self.dropped["stale"] = self.dropped.get("stale", 0) + 1
                self.stale_sessions.append(sample.session_id)
            else:
                kept.append(sample)
        if not kept:
            self.groups_lost += 1
            return None
        return SampleGroup(group_id=group.group_id, task_id=group.task_id, samples=kept)
