"""The engine worker's weight loading: from a published version to the engine serving it.

Weight-sync broadcasts each new version (``LoadWeights``) and answers which one engines
should serve now, with the chain of payloads that builds it (``CurrentVersionQuery``);
with ``SF_WEIGHTS_GROUP_BACKEND`` the trainer also pushes payloads to a group the engine
joins. ``WeightLoader`` turns either into the served version: it fetches the payloads
from their store and checks them (``seamlessflow.weights.WeightReceiver``), swaps the
whole set into the engine between decode steps as ``SF_ENGINE_INTERRUPT_MODE`` says, and
announces ``WeightsLoaded``. It also keeps the worker's version bookkeeping: a
request's version floor (``reach``), the periodic catch-up that repairs a missed
broadcast (``poll_loop``), and ``asleep``, set while the engine is lent out of rollout
(it catches up when it serves again).

Invariants: the engine is handed a version only after every payload of it arrived and
was checked (docs/architecture.md, invariant 5); ``lock`` is held for a whole load, and
the worker's release and shed paths take it too, so neither runs in the middle of a swap.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from seamlessflow import telemetry, weights
from seamlessflow.bus import Bus, NoResponder
from seamlessflow.protocol import (
    CurrentVersion,
    CurrentVersionQuery,
    LoadWeights,
    WeightManifest,
    WeightsLoaded,
)
from seamlessflow.resources import ResourceMembership
from seamlessflow.retry import RetryPolicy, retry
from seamlessflow.weights import VersionGap
from seamlessflow.weights.collective import Received
from seamlessflow.weights.group import PushListener, how_buckets_travel, join_as_engine
from seamlessflow.weights.settings import WeightTransferSettings
from sf_engine.backends import InferenceEngine
from sf_engine.in_flight import InFlight
from sf_engine.settings import EngineSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)

CURRENT_VERSION_RETRY = RetryPolicy(
    retry_on=(NoResponder,), first_delay_s=0.1, backoff=2.0, max_delay_s=2.0
)
"""A current-version query nobody answers (weight-sync starts after the engine, or
restarts) is asked again after 0.1 s, doubling to 2 s, until weight-sync answers."""

CURRENT_VERSION_TIMEOUT_S = 2.0
"""How long one current-version query waits for weight-sync's answer."""


class WeightLoader:
    """Brings one engine to the versions weight-sync publishes (see the module docstring).

    ``membership`` carries the phase (``sync`` during a swap) and the version served to
    the tag-scheduler; ``in_flight`` says whether requests run on across a swap."""

    def __init__(
        self,
        engine_id: str,
        engine: InferenceEngine,
        settings: EngineSettings,
        bus: Bus,
        receiver: weights.WeightReceiver,
        membership: ResourceMembership,
        in_flight: InFlight,
    ) -> None:
        self.engine_id = engine_id
        self.engine = engine
        self.settings = settings
        self.bus = bus
        self.receiver = receiver
        self.membership = membership
        self.in_flight = in_flight
        self.lock = asyncio.Lock()
        """Held for a whole load; the worker's release and shed take it too."""
        self._floor_lock = asyncio.Lock()
        """Held while requests wait for their version floor (``reach``)."""
        self.asleep = False
        """Lent out of rollout: weight broadcasts are skipped until it serves again."""

    async def on_load(self, message: LoadWeights) -> None:
        """A version broadcast by weight-sync."""
        try:
            await self.load([message.manifest])
        except VersionGap as exc:
            # a delta on a version this engine does not hold: build from the whole chain
            log.info("%s: %s; catching up from the chain", self.engine_id, exc)
            await self.catch_up()

    async def load(self, chain: list[WeightManifest]) -> None:
        """Bring the engine to the chain's last version; payloads are fetched and
        checked while the engine still serves, requests pause only for the swap.
        Raises VersionGap for a chain that does not continue what the receiver holds."""
        if not chain:
            return
        target = chain[-1].version
        async with self.lock:
            if target <= self.engine.version:
                return  # already serving it (or newer): loads are idempotent
            if self.asleep:
                return  # lent out of rollout: it catches up when lent back
            try:
                held = await self.receiver.follow(chain)
            except (weights.WeightsCorrupted, weights.PayloadMissing) as exc:
                # nothing of it is loaded; the version poll tries the current chain again
                log.warning("%s: version %d not loaded: %s", self.engine_id, target, exc)
                return
            if held == target:
                await self._serve_held(chain[-1].kind)

    async def pushed(self, received: Received) -> None:
        """A payload broadcast by the trainer's push group (``SF_WEIGHTS_GROUP_*``)."""
        manifest = received.manifest
        async with self.lock:
            try:
                held = await self.receiver.accept(received)
            except (VersionGap, weights.WeightsCorrupted) as exc:
                log.warning("%s: pushed version %d refused (%s); it will be pulled",
                            self.engine_id, manifest.version, exc)  # fmt: skip
                return
            if not self.asleep and held > self.engine.version:
                await self._serve_held(f"{manifest.kind}, pushed")

    async def _serve_held(self, how: str) -> None:
        """Swap the engine to the version the receiver holds and announce it (the caller
        holds ``lock``)."""
        version = self.receiver.version
        await self._swap(self.receiver.tensors(), version)
        # the engine holds the version in its own weights now: a copy on the device
        # goes back to the card (the trainer and the KV cache share it)
        released = self.receiver.release_device_copy()
        if released:
            log.debug("%s: %d bytes of version %d released from the device",
                      self.engine_id, released, version)  # fmt: skip
        self.membership.version = version
        await self.bus.publish(
            self.bus.subjects.weights_loaded(),
            WeightsLoaded(engine_id=self.engine_id, version=version),
        )
        log.info("%s loaded version %d (%s)", self.engine_id, version, how)

    async def _swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Partial rollout: interrupt requests in flight as configured, load, resume."""
        mode = self.settings.interrupt_mode
        self.membership.set_phase("sync")
        with tracer.start_as_current_span(
            "engine.interrupt",
            attributes={
                "engine.id": self.engine_id,
                "version": version,
                "mode": mode,
                "in_flight": len(self.in_flight),
            },
        ):
            if mode == "wait":
                await self.engine.load_weights(state_dict, version)  # waits for the batch
            else:
                await self.engine.pause(mode)
                try:
                    await self.engine.load_weights(state_dict, version)
                finally:
                    await self.engine.resume()
        self.membership.set_phase("rollout" if self.in_flight else "idle")

    async def join_push_group(self, transfer: WeightTransferSettings) -> None:
        """Join the trainer's push group, whose payloads then also arrive by ``pushed``;
        an engine that cannot join still pulls every version from the store."""
        try:
            group = await join_as_engine(self.bus, transfer)
        except Exception as exc:  # the store still serves every version
            log.warning("%s could not join the push group: %r", self.engine_id, exc)
            return
        listener = PushListener(group, self.pushed, asyncio.get_running_loop())
        listener.start()
        log.info("%s joined the %s push group as rank %d (%s)", self.engine_id,
                 transfer.group_backend, transfer.group_rank,
                 how_buckets_travel(group))  # fmt: skip

    async def catch_up(self, min_version: int = 0) -> None:
        """Ask weight-sync for the current version until it answers, then load it.

        With ``min_version`` (an engine lent back right after a train step), also wait
        until weight-sync announces at least that version, for up to
        ``SF_ENGINE_MIN_VERSION_WAIT_S``: the trainer stored it before releasing its
        slots, so only weight-sync's announcement can lag."""

        async def ask() -> CurrentVersion:
            current: CurrentVersion = await self.bus.request(
                self.bus.subjects.weights_current(),
                CurrentVersionQuery(engine_id=self.engine_id),
                CurrentVersion,
                timeout=CURRENT_VERSION_TIMEOUT_S,
            )
            return current

        deadline = asyncio.get_running_loop().time() + self.settings.min_version_wait_s
        while True:
            current = await retry(ask, CURRENT_VERSION_RETRY)
            if current.version < min_version and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
                continue
            if current.version > self.engine.version:
                try:
                    await self.load(current.chain)
                except VersionGap as exc:  # a chain that does not start with a full payload
                    log.warning("%s: cannot build version %d: %s", self.engine_id,
                                current.version, exc)  # fmt: skip
            return

    async def reach(self, min_version: int) -> None:
        """Serve at least ``min_version`` before a request that needs it runs (a
        synchronous run's request that came before this engine loaded the version it
        belongs to), bounded by ``SF_ENGINE_MIN_VERSION_WAIT_S``. One catch-up at a time:
        a batch of such requests asks weight-sync once and the others find it loaded."""
        if min_version <= self.engine.version:
            return
        async with self._floor_lock:
            if min_version > self.engine.version:
                await self.catch_up(min_version)

    async def poll_loop(self) -> None:
        """A missed broadcast (reconnect, late start) must not leave an engine stale."""
        while True:
            await asyncio.sleep(self.settings.version_poll_s)
            await self.catch_up()
