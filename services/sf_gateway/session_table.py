"""The gateway's tables of sessions: the open ones and the finished ones, kept in step
with the trajectory stream.

Restarts: before serving, ``restore`` replays the trajectory stream and rebuilds every
session not finished (key digest, task, turn count, conversation tree with its exact
ids), so an agent's next call with the same base URL and key continues its session.
Finished sessions are remembered by id and key digest only (a 409 to late calls).

Shared sessions (several gateway processes, ``SF_GATEWAY_SHARED_SESSIONS``): ``follow``
goes on reading the stream live, applying what every process stores, and
``catch_up`` makes a request wait until this process has applied the last event stored
for its session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from seamlessflow.bus import Bus
from seamlessflow.protocol import (
    GroupClosed,
    ProtocolError,
    RewardReported,
    SessionFinished,
    SessionOpened,
    TrajectoryEvent,
    TurnRecorded,
    decode,
)
from sf_gateway.conversation import NodeKey
from sf_gateway.openai_api import ApiError
from sf_gateway.reasoning import ReasoningParser
from sf_gateway.sessions import GatewaySession, add_node, new_session
from sf_gateway.settings import GatewaySettings
from sf_gateway.templating import ChatTokenizer

log = logging.getLogger(__name__)

FOLLOW_POLL_S = 1.0
"""How often the live follower of shared sessions looks whether the service is stopping."""


class SessionTable:
    """Open and finished sessions, rebuilt from and followed on the trajectory stream."""

    def __init__(
        self,
        settings: GatewaySettings,
        bus: Bus,
        tokenizer: ChatTokenizer,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.settings = settings
        self.bus = bus
        self.tokenizer = tokenizer
        self.reasoning_parser = reasoning_parser
        self.sessions: dict[str, GatewaySession] = {}
        """Open sessions (never rebound: ``Access`` reads it in place)."""
        self.finished: OrderedDict[str, str] = OrderedDict()
        """Finished sessions, oldest first: id -> key digest (never rebound either)."""
        self._events: Any = None
        """The ordered consumer the restore read with, kept to follow the stream live."""
        self.applied_seq = 0
        """Stream sequence of the last trajectory event applied to the tables."""
        self._applied = asyncio.Condition()
        self._recorded_here: set[str] = set()
        """Request ids of turns this process recorded and has not read back yet: it
        applied them itself (reading them back would add their node twice)."""

    def open(self, opened: SessionOpened) -> GatewaySession:
        """Add the session ``opened`` announces, with an empty conversation tree."""
        session = new_session(opened, self.tokenizer, self.reasoning_parser)
        self.sessions[opened.session_id] = session
        return session

    def retire(self, session: GatewaySession) -> None:
        """A finished session's record lives in JetStream: the gateway drops its
        conversation and keeps only its id and key digest, to answer 409 to late calls
        (bounded: ``finished_sessions_kept``)."""
        session_id = session.opened.session_id
        self.sessions.pop(session_id, None)
        self.finished[session_id] = session.key_sha256
        while len(self.finished) > self.settings.finished_sessions_kept:
            self.finished.popitem(last=False)

    @contextlib.contextmanager
    def recording(self, request_id: str) -> Iterator[None]:
        """Around storing a turn this process applies itself: with shared sessions, its
        read-back is skipped; a store that fails is forgotten (it will not come back)."""
        if self.settings.shared_sessions:
            self._recorded_here.add(request_id)
        try:
            yield
        except BaseException:
            self._recorded_here.discard(request_id)
            raise

    async def restore(self) -> None:
        """Rebuild the sessions that were open before a restart, from the trajectory
        stream (every event is stored before its agent gets an answer), before serving:
        each one's key digest, task, reference and reward function (SessionOpened), its
        turn count and its conversation tree with the exact ids (TurnRecorded). An
        agent's next call, with the same base URL and key, continues where it was.
        Finished sessions are remembered as such (409 to late calls). Sessions of a
        group the trajectory service closed are not rebuilt: whatever they do next is
        ignored (a 404 tells their agent so)."""
        subjects = self.bus.subjects
        events, last_seq = await self.bus.follow(
            subjects.stream_trajectory(), subjects.trajectory_events_all()
        )
        turns: dict[str, list[TurnRecorded]] = {}
        """Open session -> its chat turns; trees are built once the replay is done."""
        closed_groups: set[str] = set()
        replayed = 0
        keep_following = False
        try:
            while last_seq:
                msg = await events.next_msg(timeout=10.0)
                replayed += 1
                try:
                    event = decode(msg.data, TrajectoryEvent)
                except ProtocolError as exc:
                    log.warning("skipping an undecodable trajectory event: %s", exc)
                else:
                    self._replay(event, turns, closed_groups)
                self.applied_seq = msg.metadata.sequence.stream
                if self.applied_seq >= last_seq:
                    break
            keep_following = self.settings.shared_sessions
        finally:
            if keep_following:
                self._events = events  # follow reads on from here
            else:
                await events.unsubscribe()
        for session_id, session in list(self.sessions.items()):
            if session.opened.group_id in closed_groups:
                del self.sessions[session_id]
                continue
            for turn in turns.get(session_id, []):
                node = NodeKey(turn.node_depth, turn.node_digest)
                add_node(session, self.tokenizer, node, turn.prompt_ids, turn.completion_ids)
        if replayed:
            log.info(
                "replayed %d trajectory events: %d sessions open, %d finished remembered",
                replayed,
                len(self.sessions),
                len(self.finished),
            )

    def _replay(
        self,
        event: TrajectoryEvent,
        turns: dict[str, list[TurnRecorded]],
        closed_groups: set[str],
    ) -> None:
        if isinstance(event, GroupClosed):
            closed_groups.add(event.group_id)
            return
        if isinstance(event, SessionOpened):
            if event.session_id not in self.sessions and event.session_id not in self.finished:
                self.open(event)
            return
        session = self.sessions.get(event.session_id)
        if session is None:
            return
        if isinstance(event, TurnRecorded):
            session.turns = max(session.turns, event.turn_index + 1)
            if event.node_digest:
                turns.setdefault(event.session_id, []).append(event)
        elif isinstance(event, SessionFinished):
            session.finished = True
            self.retire(session)
            turns.pop(event.session_id, None)

    async def follow(self, stopping: asyncio.Event) -> None:
        """With shared sessions: apply what every gateway process stores, as it is stored
        (sessions opened, turns recorded, sessions finished by the others), until
        ``stopping``. ``restore`` read the stream up to here."""
        events = self._events
        if events is None:
            return
        try:
            while not stopping.is_set():
                try:
                    msg = await events.next_msg(timeout=FOLLOW_POLL_S)
                except TimeoutError:
                    continue
                try:
                    event = decode(msg.data, TrajectoryEvent)
                except ProtocolError as exc:
                    log.warning("skipping an undecodable trajectory event: %s", exc)
                else:
                    self._apply(event)
                async with self._applied:
                    self.applied_seq = msg.metadata.sequence.stream
                    self._applied.notify_all()
        finally:
            self._events = None
            with contextlib.suppress(Exception):  # the connection may be draining
                await events.unsubscribe()

    def _apply(self, event: TrajectoryEvent) -> None:
        """One event of the live stream (another process's, or this one's read back)."""
        if isinstance(event, SessionOpened):
            if event.session_id not in self.sessions and event.session_id not in self.finished:
                self.open(event)
            return
        if isinstance(event, GroupClosed | RewardReported):
            return  # nothing of the gateway's (a closed group's sessions end by themselves)
        session = self.sessions.get(event.session_id)
        if isinstance(event, TurnRecorded):
            if event.request_id in self._recorded_here:
                self._recorded_here.discard(event.request_id)
                return
            if session is None:
                return
            session.turns = max(session.turns, event.turn_index + 1)
            if event.node_digest:
                node = NodeKey(event.node_depth, event.node_digest)
                add_node(session, self.tokenizer, node, event.prompt_ids, event.completion_ids)
        elif isinstance(event, SessionFinished) and session is not None:
            session.finished = True
            self.retire(session)

    async def catch_up(self, session_id: str) -> None:
        """With shared sessions: wait until this process has applied the last event
        stored for the session (another process may have recorded it), so a turn
        continues from the exact ids the previous one stored, wherever it ran."""
        if not self.settings.shared_sessions:
            return
        subjects = self.bus.subjects
        try:
            subject = subjects.trajectory_event(session_id)
        except ProtocolError:
            return  # no such session anywhere: the access check answers 404
        last = await self.bus.last_sequence(subjects.stream_trajectory(), subject)
        if last <= self.applied_seq:
            return
        try:
            async with asyncio.timeout(self.settings.catch_up_timeout_s), self._applied:
                await self._applied.wait_for(lambda: self.applied_seq >= last)
        except TimeoutError:
            raise ApiError(
                503,
                "this gateway process has not read the session's record yet: send the "
                "request again",
                type_="server_error",
                code="catching_up",
            ) from None
