"""Which batch the trainer trains next (``sf_trainer.delivery``): the in-order rule alone,
then the delivery over a consumer of stand-in messages (batches published whole, so no
payload is read from a broker)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

import sf_trainer.delivery
from seamlessflow.protocol import TrainBatch, encode
from sf_trainer.delivery import BATCH_REDELIVERY_DELAY_S, BatchDelivery, BatchOrder, Turn

# the in-order rule ---------------------------------------------------------------------


def test_the_next_batch_is_trained_and_an_earlier_one_only_acked() -> None:
    order = BatchOrder()
    assert order.turn_of(0, data_position=-1, now=0.0) is Turn.TRAIN
    assert order.turn_of(4, data_position=3, now=0.0) is Turn.TRAIN
    assert order.turn_of(3, data_position=3, now=0.0) is Turn.TRAINED
    assert order.turn_of(1, data_position=3, now=0.0) is Turn.TRAINED
    assert order.ahead_since is None


def test_a_batch_ahead_waits_for_the_missing_one_then_is_trained() -> None:
    order = BatchOrder()
    wait = sf_trainer.delivery.IN_ORDER_WAIT_S
    assert order.turn_of(5, data_position=3, now=100.0) is Turn.WAIT
    assert order.turn_of(6, data_position=3, now=100.0 + wait - 1) is Turn.WAIT
    # the wait counts from the first batch put back, not from each one
    assert order.turn_of(5, data_position=3, now=100.0 + wait) is Turn.TRAIN
    order.handed_over()
    assert order.ahead_since is None
    assert order.turn_of(7, data_position=5, now=500.0) is Turn.WAIT  # a fresh wait


# the delivery over a consumer ----------------------------------------------------------


@dataclass
class StandInMsg:
    """What the delivery does to a message: acked, put back (with its delay), terminated."""

    data: bytes
    headers: dict[str, str] | None = None
    subject: str = "sf.test.batch.default.ready"
    done: list[Any] = field(default_factory=list)

    async def ack_sync(self) -> None:
        self.done.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.done.append(("nak", delay))

    async def term(self) -> None:
        self.done.append("term")


class StandInConsumer:
    def __init__(self, messages: list[StandInMsg]) -> None:
        self.messages = list(messages)

    async def next(self, timeout: float) -> StandInMsg | None:
        if self.messages:
            return self.messages.pop(0)
        await asyncio.sleep(timeout)
        return None


def batch_msg(index: int, policy: str = "default") -> StandInMsg:
    return StandInMsg(encode(TrainBatch(batch_index=index, groups=[], policy=policy)))


def delivery_of(messages: list[StandInMsg], stopping: asyncio.Event | None = None) -> BatchDelivery:
    # a batch published whole is itself: the bus is never asked for a payload
    return BatchDelivery(
        None,
        StandInConsumer(messages),
        "default",
        stopping or asyncio.Event(),
    )


async def test_only_the_next_batch_of_the_policy_is_handed_to_the_step() -> None:
    malformed = StandInMsg(b"not a batch")
    foreign = batch_msg(3, policy="verifier")
    trained_before = batch_msg(2)
    ahead = batch_msg(4)
    following = batch_msg(3)
    delivery = delivery_of([malformed, foreign, trained_before, ahead, following])
    handed = [await delivery.next(data_position=2) for _ in range(5)]
    assert handed[:4] == [None] * 4
    assert malformed.done == ["term"] and foreign.done == ["term"]
    assert trained_before.done == ["ack"]
    assert ahead.done == [("nak", BATCH_REDELIVERY_DELAY_S)]
    delivered = handed[4]
    assert delivered is not None and delivered.msg is following
    assert delivered.batch.batch_index == 3 and following.done == []  # acked after its step
    assert delivered.wait_seconds >= 0.0
    assert delivery.order.ahead_since is None  # the wait for batch 3 is over


async def test_a_batch_ahead_is_trained_once_the_wait_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sf_trainer.delivery, "IN_ORDER_WAIT_S", 0.0)
    ahead = batch_msg(7)
    delivered = await delivery_of([ahead]).next(data_position=2)
    assert delivered is not None and delivered.batch.batch_index == 7


async def test_a_stop_ends_the_wait_for_a_batch() -> None:
    stopping = asyncio.Event()
    delivery = delivery_of([], stopping)
    waiting = asyncio.create_task(delivery.next(data_position=-1))
    await asyncio.sleep(0.05)  # it waits for a batch that never comes: the test's subject
    assert not waiting.done()
    stopping.set()
    assert await asyncio.wait_for(waiting, 5) is None
