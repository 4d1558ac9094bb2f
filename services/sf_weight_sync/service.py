"""weight-sync: decides which weight version engines serve and tells them.

One weight-sync per policy (``SF_POLICY``): each policy has its own version line.

Consumes:
- ``sf.<run>.weights.<policy>.published`` (JetStream ``SF_<RUN>_WEIGHTS-<policy>``,
  durable consumer ``weight-sync``: WeightsPublished from the policy's trainer)
- ``sf.<run>.weights.<policy>.current`` (request CurrentVersionQuery -> CurrentVersion)
- ``sf.<run>.weights.<policy>.loaded`` (WeightsLoaded from engines)
- ``sf.<run>.sched.phase`` (PhaseChanged from the tag-scheduler: an engine declared
  dead is forgotten)
Produces:
- ``sf.<run>.engine.<policy>.load`` (LoadWeights broadcast to the policy's engines: the
  new version's manifest; a ``cuda_ipc`` version first announced with its fallback
  pending is broadcast again once completed, for engines that could not map it)

weight-sync moves no weight bytes: the trainer stores payloads (``seamlessflow.weights``)
and engines fetch them. It keeps the chain that builds the current version (the latest
full payload and the deltas after it); the chain survives a restart because it is
re-read from the stream. An engine that missed a broadcast, or cannot apply a delta
because it holds another version, asks ``weights.current`` and gets the whole chain.
"""

from __future__ import annotations

import asyncio
import logging
import time

from seamlessflow import telemetry
from seamlessflow.bus import JETSTREAM_SETUP_RETRY, DurableConsumer, ack_redeliverable
from seamlessflow.protocol import (
    WEIGHT_SYNC_DURABLE,
    CurrentVersion,
    CurrentVersionQuery,
    LoadWeights,
    PhaseChanged,
    WeightManifest,
    WeightsLoaded,
    WeightsPublished,
    decode,
)
from seamlessflow.retry import retry
from seamlessflow.service import ServiceContext, supervise
from seamlessflow.weights.chain import VersionChain
from sf_weight_sync.settings import WeightSyncSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class WeightSyncService:
    name = "weight-sync"

    def __init__(self, settings: WeightSyncSettings | None = None) -> None:
        self.settings = settings or WeightSyncSettings()
        self.chain = VersionChain()
        self.engine_versions: dict[str, int] = {}
        """Engines heard from within ``engine_expiry_s`` -> the version each reported."""
        self._heard_at: dict[str, float] = {}
        """Engine -> when it was last heard from; oldest first (re-inserted on contact)."""
        self._loaded = asyncio.Condition()
        self._watchers: set[asyncio.Task[None]] = set()
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        subjects = ctx.subjects
        # Read at start, like the streams' set-up: on a cluster still electing the
        # stream's leader it times out, and is asked again (started without torch, this
        # service asks within a second of the cluster's start: it failed there once).
        await retry(self._reload_chain, JETSTREAM_SETUP_RETRY)
        await ctx.bus.subscribe(subjects.weights_loaded(), WeightsLoaded, self._on_loaded)
        await ctx.bus.subscribe(subjects.sched_phase(), PhaseChanged, self._on_phase)
        await ctx.bus.serve(subjects.weights_current(), CurrentVersionQuery, self.on_query)
        async with ctx.bus.durable_consumer(
            subjects.stream_weights(), subjects.weights_published(), WEIGHT_SYNC_DURABLE
        ) as published:
            log.info("weight-sync up at version %d", self.chain.version)
            self.ready.set()
            try:
                await supervise(ctx.stopping, self._published_loop(published))
            finally:
                for watcher in self._watchers:
                    watcher.cancel()

    async def on_query(self, query: CurrentVersionQuery) -> CurrentVersion:
        async with self._loaded:
            self._heard_from(query.engine_id, 0)
            self._loaded.notify_all()  # waiters re-check without the engines now silent
        return CurrentVersion(version=self.chain.version, chain=list(self.chain.manifests))

    def _heard_from(self, engine_id: str, version: int) -> None:
        """``engine_id`` is alive and serves at least ``version``; engines silent for
        longer than ``engine_expiry_s`` are forgotten."""
        self._heard_at.pop(engine_id, None)
        self._heard_at[engine_id] = time.monotonic()
        self.engine_versions[engine_id] = max(self.engine_versions.get(engine_id, 0), version)
        self._forget_silent()

    def _forget_silent(self) -> None:
        cutoff = time.monotonic() - self.settings.engine_expiry_s
        for engine_id, heard_at in list(self._heard_at.items()):
            if heard_at >= cutoff:
                break  # the rest were heard from later
            self._forget(engine_id)

    def _forget(self, engine_id: str) -> None:
        self._heard_at.pop(engine_id, None)
        self.engine_versions.pop(engine_id, None)

    async def _reload_chain(self) -> None:
        """After a restart: walk the stream back from its last message to the latest
        full payload, then replay forward. Changes nothing until every read is done (a
        retry starts afresh)."""
        subjects, bus = self.ctx.subjects, self.ctx.bus
        last = await bus.last_stored(subjects.stream_weights(), subjects.weights_published())
        if last is None:
            return
        found: list[WeightManifest] = []
        sequence = last.seq
        while sequence > 0:
            raw = await bus.stored_at(subjects.stream_weights(), sequence)
            if raw is None:
                break
            sequence -= 1
            if raw.subject != subjects.weights_published() or not raw.data:
                continue
            try:
                manifest = decode(raw.data, WeightsPublished).manifest
            except ValueError as exc:  # JetStream stores anything; the chain skips it
                log.warning("skipping an undecodable weights announcement: %s", exc)
                continue
            found.append(manifest)
            if manifest.kind == "full":
                break
        for manifest in reversed(found):
            self.chain.extend(manifest)

    async def _published_loop(self, consumer: DurableConsumer) -> None:
        # Checked on every turn: on Python 3.11 a cancellation that lands as fetch's
        # time-out fires comes out as a TimeoutError, which alone would keep us looping.
        while not self.ctx.stopping.is_set():
            msg = await consumer.next(timeout=1.0)
            if msg is None:
                continue
            try:
                published = decode(msg.data, WeightsPublished)
            except ValueError as exc:
                log.warning("terminating malformed weights message: %s", exc)
                await msg.term()
                continue
            with telemetry.extracted_context(msg.headers):
                await self._sync(published)
            await ack_redeliverable(msg)  # a redelivered version is not synced again

    async def _sync(self, published: WeightsPublished) -> None:
        manifest = published.manifest
        completing = self.chain.completes(manifest)
        if manifest.version <= self.chain.version and not completing:
            return  # a redelivery after a restart: already the current version
        if not self.chain.extend(manifest):
            # a delta on a version this chain does not end with: engines could never
            # build it, so it is not announced; the trainer's next full payload is
            log.error("version %d: a delta on %d, but the chain ends at %d; skipped",
                      manifest.version, manifest.base_version, self.chain.version)  # fmt: skip
            return
        started = time.monotonic()
        attributes = {
            "version": manifest.version,
            "kind": manifest.kind,
            "bytes": manifest.payload_bytes,
            "state.bytes": manifest.state_bytes,
            "transport": manifest.transport,
        }
        with tracer.start_as_current_span("weights.sync", attributes=attributes) as span:
            await self.ctx.bus.publish(
                self.ctx.subjects.engine_load(), LoadWeights(manifest=manifest)
            )
            span.set_attribute("engines.known", len(self.engine_versions))
        if completing:  # for engines that could not map it; the others hold it already
            return
        watcher = asyncio.create_task(self._await_engines(manifest.version, started))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)

    async def _await_engines(self, version: int, started: float) -> None:
        """Log how long every known engine took to serve ``version`` (or who lagged)."""

        def all_loaded() -> bool:
            self._forget_silent()
            return all(v >= version for v in self.engine_versions.values())

        try:
            async with self._loaded, asyncio.timeout(self.settings.sync_timeout_s):
                await self._loaded.wait_for(all_loaded)
            log.info("version %d on all %d engines after %.2fs", version,
                     len(self.engine_versions), time.monotonic() - started)  # fmt: skip
        except TimeoutError:
            lagging = [e for e, v in self.engine_versions.items() if v < version]
            log.warning("version %d not loaded by %s after %.0fs", version, lagging,
                        self.settings.sync_timeout_s)  # fmt: skip

    async def _on_loaded(self, loaded: WeightsLoaded) -> None:
        async with self._loaded:
            self._heard_from(loaded.engine_id, loaded.version)
            self._loaded.notify_all()

    async def _on_phase(self, changed: PhaseChanged) -> None:
        if changed.phase == "dead" and changed.resource_id in self.engine_versions:
            async with self._loaded:
                self._forget(changed.resource_id)
                self._loaded.notify_all()
