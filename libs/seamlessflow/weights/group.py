"""Forming the push group and running its two ends in the mesh.

- The trainer (rank 0) forms the group (``form_as_trainer``): with ``nccl`` it serves
  the NCCL unique id on ``weights.group`` so engines can build their communicators;
  with ``gloo`` it hosts the TCP rendezvous, and when every member maps the ring it
  makes in shared memory, buckets go through that (``ring``, ``group_shared_memory``).
  Forming blocks until every member joined (``group_timeout_s``), so the trainer
  forms it before its first step.
- Each engine in the group (``join_as_engine``) gets the id over NATS, joins, and runs
  ``PushListener`` in a thread: every payload received is handed to the engine's event
  loop and applied through the same ``WeightReceiver`` as pulled payloads.

A broken group (a member died) never stops training: the trainer logs it, stops pushing
and engines keep pulling from the store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine
from datetime import timedelta
from typing import Any, TypeVar

import torch

from seamlessflow.bus import Bus, NoResponder
from seamlessflow.protocol import WeightsGroupOffer, WeightsGroupQuery
from seamlessflow.retry import RetryPolicy, retry
from seamlessflow.weights import collective
from seamlessflow.weights.collective import Collective, Received
from seamlessflow.weights.ring import RingCollective, same_host_ring
from seamlessflow.weights.settings import WeightTransferSettings

log = logging.getLogger(__name__)
T = TypeVar("T")

GROUP_OFFER_RETRY = RetryPolicy(retry_on=(NoResponder,), first_delay_s=1.0)
"""An engine asks for the push group's offer every second until the trainer, which
forms the group, is up and answers."""


def _gloo(settings: WeightTransferSettings) -> Collective:
    group = collective.GlooGroup(
        settings.group_address,
        settings.group_rank,
        settings.group_size,
        timedelta(seconds=settings.group_timeout_s),
    )
    if settings.group_shared_memory == "off":
        return group
    return same_host_ring(group, settings.shm_dir, settings.bucket_bytes, settings.group_timeout_s)


async def form_as_trainer(bus: Bus, settings: WeightTransferSettings) -> Collective:
    if settings.group_backend == "gloo":
        return await in_daemon_thread(lambda: _gloo(settings))
    unique_id = collective.CupyNcclCollective.new_unique_id()

    async def offer(query: WeightsGroupQuery) -> WeightsGroupOffer:
        return WeightsGroupOffer(unique_id=list(unique_id), size=settings.group_size)

    subscription = await bus.serve(bus.subjects.weights_group(), WeightsGroupQuery, offer)
    try:
        return await in_daemon_thread(
            lambda: collective.CupyNcclCollective(settings.group_size, 0, unique_id)
        )
    finally:
        await bus.unserve(subscription)


async def join_as_engine(bus: Bus, settings: WeightTransferSettings) -> Collective:
    if settings.group_backend == "gloo":
        return await in_daemon_thread(lambda: _gloo(settings))

    async def ask() -> WeightsGroupOffer:
        offer: WeightsGroupOffer = await bus.request(
            bus.subjects.weights_group(),
            WeightsGroupQuery(rank=settings.group_rank),
            WeightsGroupOffer,
            timeout=5.0,
        )
        return offer

    offer = await retry(ask, GROUP_OFFER_RETRY)
    rank, unique_id = settings.group_rank, tuple(offer.unique_id)
    return await in_daemon_thread(
        lambda: collective.CupyNcclCollective(offer.size, rank, unique_id)
    )


def how_buckets_travel(group: Collective) -> str:
    """For the logs of both ends."""
    if isinstance(group, RingCollective):
        return "buckets through shared memory"
    return "buckets over the group's connections"


Apply = Callable[[Received], Coroutine[Any, Any, None]]


class PushListener:
    """Receives broadcasts in a thread (collectives block) until the trainer stops them."""

    def __init__(self, group: Collective, apply: Apply, loop: asyncio.AbstractEventLoop) -> None:
        self.group = group
        self.apply = apply
        self.loop = loop
        self.received = 0
        self._buffers = [collective.new_buffer(0), collective.new_buffer(0)]
        self.thread = threading.Thread(target=self._run, name="weights-push", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """Where the next payload lands: the two buffers in turn, each grown to the
        largest payload it held. Payload k lands in the buffer of payload k - 2, whose
        apply has settled (``_run`` waits for it before handing over payload k - 1);
        payload k - 1's apply may still be reading the other one."""
        index = self.received % 2
        if self._buffers[index].numel() < nbytes:
            self._buffers[index] = collective.new_buffer(0)  # the old one is freed first
            self._buffers[index] = collective.new_buffer(nbytes)
        return self._buffers[index][:nbytes]

    def _run(self) -> None:
        pending: concurrent.futures.Future[None] | None = None
        try:
            while (received := collective.receive(self.group, buffer=self._buffer)) is not None:
                self.received += 1
                if pending is not None:
                    # at most one payload waits to be applied: memory stays bounded, and
                    # the trainer's broadcast never waits for an engine's swap
                    _settled(pending)
                pending = asyncio.run_coroutine_threadsafe(self.apply(received), self.loop)
        except Exception as exc:  # a broken group: keep pulling from the store
            log.warning("push group ended: %r; pulling from the store only", exc)
        finally:
            with contextlib.suppress(Exception):
                collective.close(self.group)


def _settled(pending: concurrent.futures.Future[None]) -> None:
    """Wait for the previous apply; its failure is the engine's to report (the next
    version is pulled), not a reason to leave the group."""
    try:
        pending.result()
    except Exception as exc:
        log.warning("a pushed payload was not applied: %r", exc)


async def in_daemon_thread(function: Callable[[], T]) -> T:
    """``asyncio.to_thread`` for calls that may block until a timeout (forming a group):
    a daemon thread never holds up the process's exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = function()
        except BaseException as exc:
            loop.call_soon_threadsafe(_settle, future, None, exc)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=run, name="weights-group", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[T], result: T | None, error: BaseException | None) -> None:
    if future.done():
        return  # the waiter was cancelled (the process is stopping)
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]
