"""Pure logic of the trajectory service: sessions -> samples -> groups -> batches.

Over 400 lines: one pure pipeline from events to batches, tested as one (test_grouping).

No I/O here, so it is tested directly and rebuilt deterministically by replaying the
trajectory stream after a restart.

Multi-policy: one session may call several policies (a solver and a verifier). Each
policy has its own ``Grouper``, fed every event: it keeps the turns its engines made,
so a session yields one sample per policy it used, in that policy's group and batch.
Rewards: a reward reported for the policy wins, then one reported for the whole
session; the task's verifier (``reward_fn``) scores only the task's policy's answer
(``SessionOpened.policy``), since the other policies answer other questions.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from seamlessflow.protocol import (
    DEFAULT_POLICY,
    UNRECORDED_TEMPERATURE,
    ExportedSample,
    GroupClosed,
    RewardReported,
    SampleGroup,
    SessionExport,
    SessionFinished,
    SessionOpened,
    TrainSample,
    TrajectoryEvent,
    TurnRecorded,
)
from sf_trajectory.data_filters import DataFilters

log = logging.getLogger(__name__)

RewardLookup = Callable[[str], Callable[[str, str], float]]


@dataclass
class Session:
    """One session as one policy sees it: only the turns that policy's engines made."""

    opened: SessionOpened
    policy: str = DEFAULT_POLICY
    turns: list[TurnRecorded] = field(default_factory=list)
    reported_reward: float | None = None
    reported_for_policy: bool = False
    """``reported_reward`` was reported for this policy by name (a session-wide report
    then no longer overrides it)."""
    finished: bool = False
    verified_reward: float | None = None
    """The verifier's score, computed off the event loop before the finish is applied
    (``Grouper.pending_verification``)."""
    verification_failed: bool = False
    failure: str = ""
    """Why the episode failed, as its agent runner reported at the finish (the sample
    is dropped with this reason); empty if it did not."""


def branch(
    turns: list[TurnRecorded], leaf: TurnRecorded, exclude: frozenset[int] = frozenset()
) -> tuple[TrainSample, list[int]]:
    """The token sequence ending at ``leaf``, with every turn on it masked in.

    The sequence is the leaf's prompt + completion. A turn whose prompt and completion lie
    on that sequence (same ids at the same positions) contributes its completion tokens to
    the loss mask; a turn from another branch does not, nor one in ``exclude`` (turn
    indexes already trained in another sample of the session), nor a ``constrained`` one
    (its logprobs are not the weights' distribution: it is context only). Every
    masked-in token is one the engine produced (docs/architecture.md, invariant 1), with
    the logprob, version and temperature it was produced with. The sample's
    ``finish_reason`` is the leaf's: how its last generation ended.
    """
    token_ids = [*leaf.prompt_ids, *leaf.completion_ids]
    loss_mask = [0] * len(token_ids)
    logprobs = [0.0] * len(token_ids)
    versions = [-1] * len(token_ids)
    temperatures = [1.0] * len(token_ids)
    on_path = []
    for turn in turns:
        start = len(turn.prompt_ids)
        end = start + len(turn.completion_ids)
        if token_ids[:start] != turn.prompt_ids or token_ids[start:end] != turn.completion_ids:
            continue
        if turn.turn_index in exclude:
            continue
        on_path.append(turn.turn_index)
        if turn.constrained:  # its logprobs are not the weights' distribution: context only
            continue
        loss_mask[start:end] = [1] * (end - start)
        logprobs[start:end] = turn.logprobs
        versions[start:end] = turn.versions
        temperature = UNRECORDED_TEMPERATURE if turn.temperature is None else turn.temperature
        temperatures[start:end] = [temperature] * (end - start)
    sample = TrainSample(
        session_id=leaf.session_id,
        token_ids=token_ids,
        loss_mask=loss_mask,
        behaviour_logprobs=logprobs,
        versions=versions,
        reward=0.0,
        temperatures=temperatures,
        finish_reason=leaf.finish_reason,
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


def message_chain(turns: list[TurnRecorded], last: TurnRecorded) -> list[TurnRecorded]:
    """``last`` and the turns it continued by messages (``parent_digest``), nearest first:
    the conversation the agent kept, whatever the template did to its tokens."""
    chain = [last]
    position = turns.index(last)
    while chain[-1].parent_digest:
        wanted = chain[-1].parent_digest
        parents = [i for i in range(position) if turns[i].node_digest == wanted]
        if not parents:
            break  # continued a turn of another policy, or one not stored
        position = parents[-1]
        chain.append(turns[position])
    return chain


def trained_branches(
    turns: list[TurnRecorded],
) -> list[tuple[TurnRecorded, TrainSample, list[int]]]:
    """The samples a session trains: each with the turn it ends at and the turn
    indexes it masks in.

    First the branch ending at the session's last turn. Then, for each earlier turn
    that conversation continued by messages (``message_chain``) whose tokens are not on
    a branch already taken (its reply was rewritten by the chat template, so the next
    prompt continued its prompt, not its completion), the branch ending at that turn.
    Every turn the agent kept is thus trained, each exactly once (a turn already masked
    in is left out of later branches); turns on branches the agent abandoned (edited
    history, n > 1 siblings not continued) are not."""
    if not turns:
        return []
    taken: set[int] = set()
    samples = []
    for turn in message_chain(turns, turns[-1]):
        if turn.turn_index in taken:
            continue
        sample, on_path = branch(turns, turn, frozenset(taken))
        taken.update(on_path)
        samples.append((turn, sample, on_path))
    return samples


def build_samples(session: Session, reward: float) -> list[TrainSample]:
    """The session's trained samples (``trained_branches``), each with its reward."""
    samples = [sample for _, sample, _ in trained_branches(session.turns)]
    for sample in samples:
        sample.reward = reward
    return samples


def build_sample(session: Session, reward: float) -> TrainSample | None:
    """The trajectory ending at the session's last turn (see ``branch``)."""
    samples = build_samples(session, reward)
    return samples[0] if samples else None


def session_reward(session: Session, reward_lookup: RewardLookup) -> float | None:
    """A reward the agent reported wins; else the task's verifier on the last answer
    (of the task's policy only)."""
    if session.reported_reward is not None:
        return session.reported_reward
    if session.verified_reward is not None:
        return session.verified_reward
    if session.verification_failed or not session.turns or not session.opened.reward_fn:
        return None
    if session.policy != session.opened.policy:
        return None
    reward_fn = reward_lookup(session.opened.reward_fn)
    return float(reward_fn(session.turns[-1].completion_text, session.opened.reference))


def record_reward(session: Session, event: RewardReported) -> None:
    """Apply a reported reward to one policy's view of the session."""
    if event.policy == session.policy:
        session.reported_reward, session.reported_for_policy = event.reward, True
    elif not event.policy and not session.reported_for_policy:
        session.reported_reward = event.reward


def export_session(events: list[TrajectoryEvent], reward_lookup: RewardLookup) -> SessionExport:
    """Every branch of one session's conversation tree, per policy, from its events."""
    opened = next((e for e in events if isinstance(e, SessionOpened)), None)
    if opened is None:
        raise ValueError("the events hold no SessionOpened")
    policies = [opened.policy]
    for event in events:
        if isinstance(event, TurnRecorded) and event.policy not in policies:
            policies.append(event.policy)
    finish = next((e for e in events if isinstance(e, SessionFinished)), None)
    finished = finish is not None
    failure = finish.failure if finish is not None else ""
    tool_call_errors = Counter(
        kind for e in events if isinstance(e, TurnRecorded) for kind in e.tool_call_errors
    )
    step_rewards: list[float] = next(
        (e.step_rewards for e in reversed(events) if isinstance(e, RewardReported)), []
    )
    samples = []
    for policy in policies:
        session = Session(opened=opened, policy=policy, finished=finished)
        for event in events:
            if isinstance(event, TurnRecorded) and event.policy == policy:
                session.turns.append(event)
            elif isinstance(event, RewardReported):
                record_reward(session, event)
        reward = None
        if finished and not failure:
            try:
                reward = session_reward(session, reward_lookup)
            except Exception as exc:  # the batch path logs it and drops the sample too
                log.warning("reward %r failed on session %s: %s",
                            opened.reward_fn, opened.session_id, exc)  # fmt: skip
        trained = {
            end.turn_index: (sample, on_path)
            for end, sample, on_path in trained_branches(session.turns)
        }
        ends = {t.turn_index for t in leaves(session.turns)} | set(trained)
        for end in (t for t in session.turns if t.turn_index in ends):
            if end.turn_index in trained:  # as the trainer gets it
                sample, on_path = trained[end.turn_index]
            else:
                sample, on_path = branch(session.turns, end)
            final = end is session.turns[-1]
            samples.append(
                ExportedSample(
                    token_ids=sample.token_ids,
                    loss_mask=sample.loss_mask,
                    behaviour_logprobs=sample.behaviour_logprobs,
                    versions=sample.versions,
                    temperatures=sample.temperatures,
                    turn_indexes=on_path,
                    final=final,
                    reward=reward if end.turn_index in trained else None,
                    policy=policy,
                )
            )
    return SessionExport(
        session_id=opened.session_id,
        task_id=opened.task_id,
        finished=finished,
        samples=samples,
        step_rewards=list(step_rewards),
        failure=failure,
        tool_call_errors=dict(tool_call_errors),
    )


@dataclass
class Group:
    group_id: str
    task_id: str
    size: int
    samples: list[TrainSample] = field(default_factory=list)
    """A finished session gives one sample or more (``trained_branches``)."""
    done: int = 0
    """Sessions that gave samples."""
    failed: int = 0
    opened: set[int] = field(default_factory=set)
    """Sample indexes whose session opened."""
    tool_call_errors: Counter[str] = field(default_factory=Counter)
    """The malformed tool calls of the sessions that gave its samples, by kind."""

    @property
    def complete(self) -> bool:
        return self.done + self.failed >= self.size


@dataclass
class BatchTally:
    """What happened to groups and samples while one batch was formed (see
    ``BatchFilterReport``)."""

    groups_dropped: Counter[str] = field(default_factory=Counter)
    samples_dropped: Counter[str] = field(default_factory=Counter)
    groups_waived: Counter[str] = field(default_factory=Counter)
    dropped_samples: dict[str, list[str]] = field(default_factory=dict)
    """The samples behind ``samples_dropped``: session ids, or ``sample_id``."""
    dropped_groups: dict[str, list[str]] = field(default_factory=dict)
    """The groups behind ``groups_dropped``."""
    tool_call_errors: Counter[str] = field(default_factory=Counter)
    """Malformed tool calls of the sessions in the batch and of those dropped."""


class Grouper:
    """Folds trajectory events into complete groups, and groups into batches, for one
    policy (``policy``): only turns its engines made go into its samples.

    ``already_batched`` holds the session ids that are in a published batch already:
    replaying the event stream after a restart skips them, so no trajectory is batched
    twice (docs/architecture.md, invariant 4). ``finished_groups`` holds the groups that
    are complete (closed ones included) or batched: a session that opens in one later
    (its group timed out without it, or it was trimmed from a batched group) is never a
    sample. ``reported`` holds the samples and groups a published batch report counted
    as dropped: a replay rebuilds the same drops but does not report them twice.

    Every complete group is shown to the prompt-set filters (``filters.observe``), then
    judged once by the group filters against the batch it will join (``take_batch``).
    """

    def __init__(
        self,
        reward_lookup: RewardLookup,
        already_batched: set[str] | None = None,
        *,
        filters: DataFilters | None = None,
        policy: str = DEFAULT_POLICY,
    ):
        self.policy = policy
        self.reward_lookup = reward_lookup
        self.already_batched = already_batched or set()
        self.finished_groups: set[str] = set()
        self.closed_unopened: set[str] = set()
        """Samples (``sample_id``) dropped because their group closed before they opened."""
        self.reported: set[str] = set()
        self.filters = filters or DataFilters()
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, Group] = {}
        self.ready: list[SampleGroup] = []
        """Complete groups waiting for a batch, in completion order. The first
        ``judged`` passed the group filters for the next batch; the rest are not judged
        yet."""
        self.judged = 0
        self.dropped: dict[str, int] = {}
        """Samples that will never be trained, by reason (since start-up)."""
        self.groups_lost = 0
        """Groups that will never be in a batch: dropped by a filter, or every sample
        failed."""
        self.tally = BatchTally()
        """Drops while the next batch forms; ``last_tally`` is the batch just taken's."""
        self.last_tally = BatchTally()
        self.group_tool_call_errors: dict[str, Counter[str]] = {}
        """The malformed tool calls of each complete group's sessions, until the group is
        batched or lost (counted then, in that batch's tally)."""

    def apply(self, event: TrajectoryEvent) -> None:
        if isinstance(event, GroupClosed):
            self._close(event)
            return
        if isinstance(event, SessionOpened):
            if event.session_id in self.already_batched:
                return
            if event.group_id in self.finished_groups:
                # Its sample was dropped when the group closed without it; else it is one
                # sample too many (an index handed out twice): dropped as ``surplus``.
                if sample_id(event.group_id, event.sample_index) not in self.closed_unopened:
                    self._count_dropped_samples("surplus", [event.session_id])
                return
            self.sessions[event.session_id] = Session(opened=event, policy=self.policy)
            group = self.groups.setdefault(
                event.group_id, Group(event.group_id, event.task_id, event.group_size)
            )
            group.opened.add(event.sample_index)
            return
        session = self.sessions.get(event.session_id)
        if session is None or session.finished:
            return  # batched before a restart, or an event after finish: nothing to do
        if isinstance(event, TurnRecorded):
            if event.policy == self.policy:
                session.turns.append(event)
        elif isinstance(event, RewardReported):
            record_reward(session, event)
        elif isinstance(event, SessionFinished):
            session.finished = True
            session.failure = event.failure
            self._finish(session)

    def pending_verification(self, event: TrajectoryEvent) -> Callable[[], None] | None:
        """For a finish whose session needs the task's verifier: the call that scores it,
        to run in a worker thread before ``apply`` (a sandboxed code verifier takes
        seconds; the event loop must not wait on it). None when nothing is to verify.
        A verifier that raises is logged and leaves the session without a reward."""
        if not isinstance(event, SessionFinished):
            return None
        session = self.sessions.get(event.session_id)
        if session is None or session.finished or session.reported_reward is not None:
            return None
        if event.failure:
            return None  # dropped with its reason: nothing to score
        if session.policy != session.opened.policy or not session.opened.reward_fn:
            return None  # only the task's policy is scored by the task's verifier

        def verify() -> None:
            try:
                session.verified_reward = session_reward(session, self.reward_lookup)
            except Exception:
                log.exception("reward %r failed on session %s: no reward",
                              session.opened.reward_fn, session.opened.session_id)  # fmt: skip
                session.verification_failed = True

        return verify

    def _finish(self, session: Session) -> None:
        opened = session.opened
        del self.sessions[opened.session_id]
        group = self.groups.get(opened.group_id)
        if group is None:  # complete without it: one sample too many
            self._count_dropped_samples("surplus", [opened.session_id])
            return
        # an episode that failed (its environment went away, ...) is no sample whatever
        # its turns and reward, and the reason is the one its agent runner reported
        reward = None if session.failure else self._reward(session)
        samples = build_samples(session, reward) if reward is not None else []
        errors = Counter(kind for turn in session.turns for kind in turn.tool_call_errors)
        if not samples:
            group.failed += 1
            reason = session.failure or ("no_turns" if not session.turns else "no_reward")
            if opened.session_id not in self.reported:
                self.tally.tool_call_errors.update(errors)
            self._count_dropped_samples(reason, [opened.session_id])
        else:
            group.samples.extend(samples)
            group.done += 1
            group.tool_call_errors.update(errors)
        if group.complete:
            self._complete(group)

    def _close(self, event: GroupClosed) -> None:
        """Drop every sample of the group that has not finished (``timed_out``): the
        sessions still open and the sample indexes that never opened one."""
        if event.group_id in self.finished_groups:
            return  # it completed before the close was applied
        group = self.groups.setdefault(
            event.group_id, Group(event.group_id, event.task_id, event.group_size)
        )
        unfinished = [
            s.opened.session_id
            for s in self.sessions.values()
            if s.opened.group_id == event.group_id
        ]
        for session_id in unfinished:
            del self.sessions[session_id]
        unopened = [
            sample_id(group.group_id, i) for i in range(group.size) if i not in group.opened
        ]
        self.closed_unopened.update(unopened)
        unfinished += unopened
        group.failed += len(unfinished)
        self._count_dropped_samples("timed_out", unfinished)
        log.warning("group %s closed after no progress: %d samples dropped (%d complete)",
                    group.group_id, len(unfinished), len(group.samples))  # fmt: skip
        self._complete(group)

    def _complete(self, group: Group) -> None:
        del self.groups[group.group_id]
        self.finished_groups.add(group.group_id)
        # Sessions of the group still open are one too many (an index handed out twice):
        # dropped now, not when they finish, since one whose agent died never does and
        # would be neither trained nor dropped (seen under load in tests/mesh/test_faults.py)
        extra = [s for s in self.sessions.values() if s.opened.group_id == group.group_id]
        for session in extra:
            del self.sessions[session.opened.session_id]
        if extra:
            self._count_dropped_samples("surplus", [s.opened.session_id for s in extra])
        self.group_tool_call_errors[group.group_id] = group.tool_call_errors
        if not group.samples:
            self._lose_group("no_samples", group.group_id)
        else:
            complete = SampleGroup(
                group_id=group.group_id, task_id=group.task_id, samples=group.samples
            )
            self.filters.observe(complete)
            self.ready.append(complete)

    def _reward(self, session: Session) -> float | None:
        return session_reward(session, self.reward_lookup)

    def take_batch(
        self, groups_per_batch: int, *, batch_index: int = 0
    ) -> list[SampleGroup] | None:
        """The next batch, or None until enough groups passed the group filters.

        Batch ``batch_index`` is trained by policy version ``batch_index``; the caller
        passes the index of the next batch, which changes only once a batch is taken.
        Each group is judged once, in completion order, and only while the batch still
        needs groups: every group that passes is in this batch, so the judgement (e.g.
        staleness) is the one for the version that will train it. A dropped group does
        not count towards the batch, so the batch is refilled from later groups.
        """
        while self.judged < min(groups_per_batch, len(self.ready)):
            kept = self._judge(self.ready[self.judged], batch_index)
            if kept is None:
                del self.ready[self.judged]
            else:
                self.ready[self.judged] = kept
                self.judged += 1
        if self.judged < groups_per_batch:
            return None
        batch, self.ready = self.ready[:groups_per_batch], self.ready[groups_per_batch:]
        self.judged = 0
        for group in batch:
            self.tally.tool_call_errors.update(self.group_tool_call_errors.pop(group.group_id, {}))
        self.last_tally, self.tally = self.tally, BatchTally()
        return batch

    def _judge(self, group: SampleGroup, batch_index: int) -> SampleGroup | None:
        """The group as the group filters leave it (None: dropped), counted by reason."""
        for verdict in self.filters.judge(group, batch_index):
            if verdict.waived:
                self.tally.groups_waived[verdict.reason] += 1
                continue
            if verdict.dropped_sessions:
                self._count_dropped_samples(verdict.reason, verdict.dropped_sessions)
            if verdict.group is None:
                self._lose_group(verdict.reason, group.group_id)
                return None
            group = verdict.group
        return group

    def _count_dropped_samples(self, reason: str, sample_ids: Sequence[str]) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + len(sample_ids)
        fresh = [i for i in sample_ids if i not in self.reported]
        if fresh:
            self.tally.samples_dropped[reason] += len(fresh)
            self.tally.dropped_samples.setdefault(reason, []).extend(fresh)

    def _lose_group(self, reason: str, group_id: str) -> None:
        self.groups_lost += 1
        errors = self.group_tool_call_errors.pop(group_id, Counter())
        if group_id not in self.reported:
            self.tally.tool_call_errors.update(errors)
            self.tally.groups_dropped[reason] += 1
            self.tally.dropped_groups.setdefault(reason, []).append(group_id)


def sample_id(group_id: str, sample_index: int) -> str:
    """How a report names a sample whose session never opened."""
    return f"{group_id}/{sample_index}"
