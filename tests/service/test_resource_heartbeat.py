"""A resource's heartbeat loop stops when its service stops, whatever it was doing.

CI once waited 60 s for an engine that never stopped: its heartbeat loop was cancelled
in the very iteration in which a beat had been asked for (a phase change as the service
stopped), and ``asyncio.wait_for`` on Python 3.11 returns the finished inner wait's
result instead of raising the cancel. The loop went on beating, and the service's task
group waited for it for ever.
"""

from __future__ import annotations

import asyncio

from seamlessflow.bus import Bus
from seamlessflow.resources import ResourceMembership


async def test_a_beat_asked_for_as_the_loop_is_cancelled_does_not_keep_it_alive(
    bus: Bus,
) -> None:
    membership = ResourceMembership(bus, "engine-beats", "engine", ["rollout"], slots=["slot-0"])
    beating = asyncio.create_task(membership.heartbeat_loop())
    try:
        await asyncio.sleep(0.2)  # the first beat is out; the loop waits for the next
        membership.set_phase("idle")  # asks for a beat now: the loop's wait ends ...
        await asyncio.sleep(0)  # ... its inner wait finishes on this turn of the loop
        beating.cancel()  # ... and the service stops in the same turn
        done, _ = await asyncio.wait([beating], timeout=5)
        assert done, "the heartbeat loop survived its cancel"
        assert beating.cancelled()
    finally:
        beating.cancel()
        membership.end_phase()
