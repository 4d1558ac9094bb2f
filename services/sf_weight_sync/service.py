"""weight-sync: decides which weight version engines serve and tells them.

Consumes:
- ``sf.<run>.weights.published`` (JetStream ``SF_<RUN>_WEIGHTS``, durable consumer
  ``weight-sync``: WeightsPublished from the trainer)
- ``sf.<run>.weights.current`` (request CurrentVersionQuery -> reply CurrentVersion)
- ``sf.<run>.weights.loaded`` (WeightsLoaded from engines)
Produces:
- ``sf.<run>.engine.load`` (LoadWeights broadcast to engines)
- object store ``sf_<run>_weights``: deletes versions older than ``keep_versions``

The current version is the newest WeightsPublished processed; it survives a restart
because it is re-read from the stream. An engine that missed a broadcast asks
``weights.current`` (catch-up), so no engine is left behind for long.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors

from seamlessflow import telemetry, weights
from seamlessflow.protocol import (
    WEIGHT_SYNC_DURABLE,
    CurrentVersion,
    CurrentVersionQuery,
    LoadWeights,
    WeightsLoaded,
    WeightsPublished,
    decode,
)
from seamlessflow.service import ServiceContext, supervise
from sf_weight_sync.config import WeightSyncSettings

log = logging.getLogger(__name__)
tracer = telemetry.tracer(__name__)


class WeightSync:
    name = "weight-sync"

    def __init__(self, settings: WeightSyncSettings | None = None) -> None:
        self.settings = settings or WeightSyncSettings()
        self.current = CurrentVersion(version=0)
        self.engine_versions: dict[str, int] = {}
        self._loaded = asyncio.Condition()
        self._watchers: set[asyncio.Task[None]] = set()
        self.ready = asyncio.Event()

    async def run(self, ctx: ServiceContext) -> None:
        self.ctx = ctx
        subjects = ctx.subjects
        try:
            last = await ctx.bus.js.get_last_msg(
                subjects.stream_weights(), subjects.weights_published()
            )
            assert last.data is not None
            self._set_current(decode(last.data, WeightsPublished))
        except nats.js.errors.NotFoundError:
            pass
        await ctx.bus.nc.subscribe(subjects.weights_loaded(), cb=self._on_loaded)
        await ctx.bus.serve(subjects.weights_current(), CurrentVersionQuery, self.on_query)
        self.published = await ctx.bus.js.pull_subscribe(
            subjects.weights_published(),
            durable=WEIGHT_SYNC_DURABLE,
            stream=subjects.stream_weights(),
        )
        log.info("weight-sync up at version %d", self.current.version)
        self.ready.set()
        try:
            await supervise(ctx.stopping, self._published_loop())
        finally:
            for watcher in self._watchers:
                watcher.cancel()
            # a pull subscription left open makes the connection's drain wait forever
            await self.published.unsubscribe()

    async def on_query(self, query: CurrentVersionQuery) -> CurrentVersion:
        self.engine_versions.setdefault(query.engine_id, 0)
        return self.current

    def _set_current(self, published: WeightsPublished) -> None:
        if published.version > self.current.version:
            self.current = CurrentVersion(
                version=published.version,
                object_name=published.object_name,
                sha256=published.sha256,
            )

    async def _published_loop(self) -> None:
        while True:
            try:
                messages = await self.published.fetch(1, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in messages:
                try:
                    published = decode(msg.data, WeightsPublished)
                except ValueError as exc:
                    log.warning("terminating malformed weights message: %s", exc)
                    await msg.term()
                    continue
                with telemetry.extracted_context(msg.headers):
                    await self._sync(published)
                await msg.ack_sync()

    async def _sync(self, published: WeightsPublished) -> None:
        if published.version <= self.current.version and self.current.object_name:
            return  # a redelivery after a restart: already the current version
        self._set_current(published)
        started = time.monotonic()
        with tracer.start_as_current_span(
            "weights.sync", attributes={"version": published.version, "bytes": published.num_bytes}
        ) as span:
            await self.ctx.bus.publish(
                self.ctx.subjects.engine_load(),
                LoadWeights(
                    version=published.version,
                    object_name=published.object_name,
                    sha256=published.sha256,
                ),
            )
            span.set_attribute("engines.known", len(self.engine_versions))
        watcher = asyncio.create_task(self._await_engines(published.version, started))
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        await self._prune(published.version)

    async def _await_engines(self, version: int, started: float) -> None:
        """Log how long every known engine took to serve ``version`` (or who lagged)."""

        def all_loaded() -> bool:
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

    async def _on_loaded(self, msg) -> None:  # type: ignore[no-untyped-def]
        try:
            loaded = decode(msg.data, WeightsLoaded)
        except ValueError:
            return
        async with self._loaded:
            previous = self.engine_versions.get(loaded.engine_id, 0)
            self.engine_versions[loaded.engine_id] = max(previous, loaded.version)
            self._loaded.notify_all()

    async def _prune(self, version: int) -> None:
        oldest_kept = version - self.settings.keep_versions + 1
        for old in range(max(1, oldest_kept - 3), oldest_kept):
            await weights.delete_weights(self.ctx.bus, weights.object_name(old))
