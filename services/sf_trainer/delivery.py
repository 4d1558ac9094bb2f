"""Which batch the trainer trains next: reading the batch consumer in order.

Batches are trained in ``batch_index`` order, each once. A message of the durable
consumer is one of (:class:`BatchOrder` decides the first three, purely):

- at or before the data position (trained before, e.g. redelivered after a restart):
  acked, not trained;
- ahead of the next one to train: put back while the one before it is awaited
  (``IN_ORDER_WAIT_S``), then trained;
- the next one (or ahead past the wait): its payload is read (``seamlessflow.batches``)
  and it is handed to the step;
- malformed, of another policy, or with its payload gone for good: terminated, with
  one error; a payload not readable now (a broker restarting): put back and retried.

:class:`BatchDelivery` runs these over the consumer and returns only a batch to train.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from dataclasses import dataclass

from seamlessflow.batches import TRANSIENT_ERRORS, BatchPayloadMissing, fetch_batch
from seamlessflow.bus import Bus, DurableConsumer, Msg, ack_redeliverable
from seamlessflow.protocol import BatchReady, TrainBatch, decode

log = logging.getLogger(__name__)

IN_ORDER_WAIT_S = 120.0
"""How long a batch that arrives ahead of its turn is put back while the one before it
is awaited. A trainer killed while it held a batch unacked leaves that batch to come
back after the consumer's ack wait (30 s), behind the ones after it; training those
first would skip it for good (it is then at or before the data position). Past this
wait, the missing batch is taken as never published and the next one is trained."""

BATCH_REDELIVERY_DELAY_S = 1.0
"""How long a batch put back on the consumer (nak) waits before it comes again: one
ahead of its turn (``IN_ORDER_WAIT_S``), or one whose payload cannot be read now (a
broker restarting). Redelivery is how a payload read is retried: the trainer never
loops on one batch, and sees a stop between tries."""

FETCH_TIMEOUT_S = 1.0
"""Longest wait for the consumer's next message before the stop is looked at again."""


class Turn(enum.Enum):
    """What to do with a batch, given the data position (:meth:`BatchOrder.turn_of`)."""

    TRAINED = "trained"
    """At or before the data position: ack it, do not train it."""
    WAIT = "wait"
    """Ahead of the next one to train, within the wait: put it back."""
    TRAIN = "train"
    """The next one, or ahead past the wait: train it."""


class BatchOrder:
    """The in-order rule, pure: a clock goes in, a :class:`Turn` comes out."""

    def __init__(self) -> None:
        self.ahead_since: float | None = None
        """Since when a batch after the next one to train has been put back."""

    def turn_of(self, batch_index: int, data_position: int, now: float) -> Turn:
        """``data_position``: ``batch_index`` of the last trained batch (-1: none)."""
        if batch_index <= data_position:
            return Turn.TRAINED
        if batch_index == data_position + 1:
            return Turn.TRAIN
        if self.ahead_since is None:
            self.ahead_since = now
            log.info("batch %d came before batch %d (held by a trainer that stopped?): "
                     "waiting for it", batch_index, data_position + 1)  # fmt: skip
        if now - self.ahead_since < IN_ORDER_WAIT_S:
            return Turn.WAIT
        log.warning("batch %d never came in %.0fs: training batch %d",
                    data_position + 1, IN_ORDER_WAIT_S, batch_index)  # fmt: skip
        return Turn.TRAIN

    def handed_over(self) -> None:
        """A batch goes to the step: the wait for a missing one, if any, is over."""
        self.ahead_since = None


@dataclass(frozen=True)
class Delivered:
    """A batch to train and its message (acked once its step is recorded)."""

    msg: Msg
    batch: TrainBatch
    wait_seconds: float
    """How long the trainer waited for the message."""


class BatchDelivery:
    """The next batch of ``policy`` to train, from its durable consumer ``batches``."""

    def __init__(
        self, bus: Bus, batches: DurableConsumer, policy: str, stopping: asyncio.Event
    ) -> None:
        self.bus = bus
        self.batches = batches
        self.policy = policy
        self.stopping = stopping
        self.order = BatchOrder()

    async def next(self, data_position: int) -> Delivered | None:
        """The next batch after ``data_position`` to train; None when this message was
        not one (acked, put back or terminated) or a stop came: ask again."""
        wait_started = time.monotonic()
        msg = await self._next_message()
        if msg is None:
            return None
        wait_seconds = time.monotonic() - wait_started
        try:
            announced = decode(msg.data, BatchReady | TrainBatch)
        except ValueError as exc:
            log.error("terminating malformed batch: %s", exc)
            await msg.term()
            return None
        if announced.policy != self.policy:
            log.error("terminating batch %d of policy %r on %r's stream",
                      announced.batch_index, announced.policy, self.policy)  # fmt: skip
            await msg.term()
            return None
        turn = self.order.turn_of(announced.batch_index, data_position, time.monotonic())
        if turn is Turn.TRAINED:
            # trained before the checkpoint this trainer resumed from
            log.info("batch %d is at or before data position %d: acked, not trained",
                     announced.batch_index, data_position)  # fmt: skip
            await ack_redeliverable(msg)
            return None
        if turn is Turn.WAIT:
            await msg.nak(delay=BATCH_REDELIVERY_DELAY_S)
            return None
        try:
            batch = await fetch_batch(self.bus, announced)
        except BatchPayloadMissing as exc:
            log.error("terminating batch %d: %s", announced.batch_index, exc)
            await msg.term()
            return None
        except TRANSIENT_ERRORS as exc:
            log.warning("batch %d: payload not readable now (%r): retrying",
                        announced.batch_index, exc)  # fmt: skip
            await msg.nak(delay=BATCH_REDELIVERY_DELAY_S)
            return None
        self.order.handed_over()
        return Delivered(msg, batch, wait_seconds)

    async def _next_message(self) -> Msg | None:
        """The consumer's next message; None once a stop came."""
        stop = asyncio.create_task(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                fetch = asyncio.create_task(self.batches.next(timeout=FETCH_TIMEOUT_S))
                await asyncio.wait({fetch, stop}, return_when=asyncio.FIRST_COMPLETED)
                if not fetch.done():
                    fetch.cancel()
                    return None
                msg = fetch.result()
                if msg is not None:
                    return msg
            return None
        finally:
            stop.cancel()
