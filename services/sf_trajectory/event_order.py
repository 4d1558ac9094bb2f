"""The order trajectory events are applied in, while the finishes they carry are
verified in worker threads.

Invariants: the events of one session are applied in the order the stream holds them,
a group's close after every event of its sessions that came before it, and one event at
a time (publishing a batch awaits). A finish that needs the task's verifier is verified
in a worker thread first; meanwhile other sessions' events go on (and their
verifications overlap, up to ``concurrency``), while its own session's later events
wait behind it. Events with nothing to wait for are applied at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from seamlessflow.protocol import GroupClosed, SessionFinished, SessionOpened, TrajectoryEvent

Verifications = Callable[[TrajectoryEvent], list[Callable[[], None]]]
"""What scores an event before it is applied (blocking calls, run in worker threads)."""


class EventOrder:
    """Applies events with ``apply``, in the order above (``verifications``: what each
    needs verified first)."""

    def __init__(
        self,
        apply: Callable[[TrajectoryEvent], Awaitable[None]],
        verifications: Verifications,
        concurrency: int,
    ) -> None:
        self._apply = apply
        self._verifications = verifications
        self._applying = asyncio.Lock()
        """One event applied at a time."""
        self._session_tails: dict[str, asyncio.Task[None]] = {}
        """Session -> the last of its events still waiting to be applied."""
        self._session_groups: dict[str, str] = {}
        """Session -> its group, from its SessionOpened until its SessionFinished is
        applied (a group's close waits for its sessions' pending events)."""
        self._pending: asyncio.TaskGroup | None = None
        self._verify_slots = asyncio.Semaphore(concurrency)
        self._verifier_threads = ThreadPoolExecutor(concurrency, thread_name_prefix="verifier")

    @contextlib.asynccontextmanager
    async def applying(self) -> AsyncIterator[None]:
        """Where events are applied: on leaving, every pending one has been; a failure
        to apply one (a publish that failed) ends the block with it."""
        async with asyncio.TaskGroup() as pending:
            self._pending = pending
            try:
                yield
            finally:
                self._pending = None

    async def apply(self, event: TrajectoryEvent) -> None:
        """Apply ``event`` now, or once what it waits for is done (inside ``applying``)."""
        waits_for = self._earlier_pending(event)
        if not waits_for and not self._verifications(event):
            async with self._applying:
                await self._apply_verified(event)
            return
        assert self._pending is not None, "events are applied inside applying()"
        task = self._pending.create_task(self._apply_in_turn(event, waits_for))
        if not isinstance(event, GroupClosed):
            session = event.session_id
            self._session_tails[session] = task
            task.add_done_callback(lambda done: self._forget_tail(session, done))

    def shutdown(self) -> None:
        """Stop the verifier threads (verifications not started are dropped)."""
        self._verifier_threads.shutdown(wait=False, cancel_futures=True)

    def _earlier_pending(self, event: TrajectoryEvent) -> list[asyncio.Task[None]]:
        """The pending applications ``event`` must come after."""
        if isinstance(event, GroupClosed):
            return [
                task
                for session, task in self._session_tails.items()
                if self._session_groups.get(session) == event.group_id
            ]
        if isinstance(event, SessionOpened):
            self._session_groups[event.session_id] = event.group_id
        tail = self._session_tails.get(event.session_id)
        return [tail] if tail is not None else []

    def _forget_tail(self, session: str, done: asyncio.Task[None]) -> None:
        if self._session_tails.get(session) is done:
            del self._session_tails[session]

    async def _apply_in_turn(
        self, event: TrajectoryEvent, waits_for: list[asyncio.Task[None]]
    ) -> None:
        if waits_for:
            await asyncio.wait(waits_for)  # a failure is the task group's to report
        verifications = self._verifications(event)  # after the session's earlier events
        if verifications:
            async with self._verify_slots:
                loop = asyncio.get_running_loop()
                await asyncio.gather(
                    *(loop.run_in_executor(self._verifier_threads, v) for v in verifications)
                )
        async with self._applying:
            await self._apply_verified(event)

    async def _apply_verified(self, event: TrajectoryEvent) -> None:
        await self._apply(event)
        if isinstance(event, SessionFinished):
            self._session_groups.pop(event.session_id, None)
        elif isinstance(event, GroupClosed):  # its unfinished sessions will never finish
            for session in [s for s, g in self._session_groups.items() if g == event.group_id]:
                del self._session_groups[session]
