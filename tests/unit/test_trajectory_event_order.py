"""The order the trajectory service applies events in (``sf_trajectory.event_order``),
with a slow verification, on plain events and no broker."""

import threading
from collections.abc import Callable

from seamlessflow.protocol import (
    GroupClosed,
    RewardReported,
    SessionFinished,
    SessionOpened,
    TrajectoryEvent,
)
from sf_trajectory.event_order import EventOrder


def opened(session: str, group: str) -> SessionOpened:
    return SessionOpened(
        session_id=session, task_id="t", group_id=group, sample_index=0, group_size=2
    )


def label(event: TrajectoryEvent) -> str:
    if isinstance(event, GroupClosed):
        return f"closed {event.group_id}"
    return f"{type(event).__name__} {event.session_id}"


async def test_a_slow_verification_holds_back_its_session_and_group_only() -> None:
    applied: list[str] = []
    release = threading.Event()

    async def apply(event: TrajectoryEvent) -> None:
        applied.append(label(event))

    def wait_for_release() -> None:
        release.wait(10)

    def verifications(event: TrajectoryEvent) -> list[Callable[[], None]]:
        slow = isinstance(event, SessionFinished) and event.session_id == "slow"
        return [wait_for_release] if slow else []

    order = EventOrder(apply, verifications, concurrency=2)
    try:
        async with order.applying():
            await order.apply(opened("slow", "g1"))
            await order.apply(opened("fast", "g2"))
            await order.apply(SessionFinished(session_id="slow"))  # verified in a thread
            await order.apply(RewardReported(session_id="slow", reward=1.0))
            await order.apply(GroupClosed(group_id="g1", task_id="t", group_size=2))
            await order.apply(SessionFinished(session_id="fast"))
            # the other session went on; the slow one's later events and its group's
            # close wait behind its finish
            assert applied == [
                "SessionOpened slow",
                "SessionOpened fast",
                "SessionFinished fast",
            ]
            release.set()
        assert applied[3:] == ["SessionFinished slow", "RewardReported slow", "closed g1"]
    finally:
        order.shutdown()
