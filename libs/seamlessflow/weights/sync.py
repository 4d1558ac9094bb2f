"""The version handshake, written once for every store and engine.

- ``WeightPublisher`` (trainer): encode -> store completely -> (push to the group, if
  any) -> return the manifest that the trainer then announces, or the same bucket by
  bucket as the version is encoded (``publish_streamed``); keeps the latest
  ``keep_chains`` chains (a full payload and the deltas after it), deletes older ones,
  and, once, every older payload in the store (those of an earlier trainer process).
- ``VersionChain`` (weight-sync, in ``chain``: no torch): the manifests that build the
  current version; a late joiner or an engine after a gap gets the whole chain.
- ``WeightReceiver`` (engine): follows a chain or a single broadcast payload from the
  version it holds, fetching at its own pace; raises ``VersionGap`` when it needs the
  chain, and never returns a partially built set.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping

import torch

from seamlessflow.bus import BROKER_ERRORS
from seamlessflow.protocol import WeightManifest
from seamlessflow.weights import collective
from seamlessflow.weights.codec import (
    BUCKET_BUFFERS,
    BucketSink,
    EncodedWeights,
    WeightEncoder,
    WeightMirror,
    WeightsCorrupted,
)
from seamlessflow.weights.collective import Collective, Received
from seamlessflow.weights.device import BufferGone
from seamlessflow.weights.ipc import DevicePayloads
from seamlessflow.weights.stores import PayloadMissing, PayloadStore, PayloadWriter

log = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(
        self,
        store: PayloadStore,
        encoder: WeightEncoder,
        keep_chains: int = 2,
        dtype: torch.dtype | None = None,
    ) -> None:
        if keep_chains < 1:
            raise ValueError("keep_chains must be at least 1")
        self.store = store
        self.encoder = encoder
        self.keep_chains = keep_chains
        self.dtype = dtype
        self.push: Collective | None = None
        """A push group (``weights.group``): each payload is also broadcast to it."""
        self._chains: list[list[WeightManifest]] = []
        self._swept = False
        """Payloads older than this process's kept chains were deleted (done once)."""
        self._sweep_due = False
        self._expired: list[WeightManifest] = []
        """Payloads of dropped chains not deleted yet (the broker was away)."""
        self._storing: asyncio.Task[WeightManifest] | None = None
        """The fallback of the newest version packed on the device, being stored."""

    async def publish(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Store ``version`` completely (cast to ``dtype`` if set); its manifest."""
        encoded = await asyncio.to_thread(self._encode, version, state_dict)
        return await self.publish_encoded(encoded)

    async def publish_encoded(self, encoded: EncodedWeights) -> WeightManifest:
        """``publish`` of a version ``encoder`` already encoded (a trainer gathers its
        shards straight into the payload: ``Learner.encode_weights``)."""
        manifest = await self.store.put(encoded)
        if self.push is not None:
            await self._broadcast(self.push, EncodedWeights(manifest, encoded.payload))
        return await self._keep(manifest)

    async def publish_streamed(
        self, version: int, encode: Callable[[BucketSink], Awaitable[WeightManifest]]
    ) -> WeightManifest:
        """``publish`` of a version that leaves as it is encoded: ``encode(sink)`` runs
        ``encoder.encode_buckets`` with ``sink`` in a worker thread (a trainer gathers
        it tensor by tensor: ``Learner.stream_weights``), and each bucket is stored, and
        broadcast to the push group, while the next one is gathered. No whole payload
        exists; the manifest is announced only after the last bucket was stored."""
        writer = await self.store.writer(version, "full")
        streaming = _StreamedVersion(self, writer, asyncio.get_running_loop())
        try:
            manifest = await encode(streaming)
        except BaseException:
            await streaming.settle()
            await writer.abort()
            if streaming.sending is not None:  # the receivers are mid-payload
                self._push_broken(RuntimeError(f"version {version} was not finished"))
            raise
        try:
            stored = await writer.close(manifest)
        except BaseException:
            await writer.abort()
            if streaming.sending is not None:  # the receivers wait for a manifest
                self._push_broken(RuntimeError(f"version {version} was not stored"))
            raise
        if streaming.sending is not None:
            try:
                await asyncio.to_thread(streaming.sending.finish, stored)
            except Exception as exc:
                self._push_broken(exc)
        return await self._keep(stored)

    @property
    def packs_on_device(self) -> bool:
        """Versions are packed where the trainer computes (``publish_packed``): the
        ``cuda_ipc`` store with the trainer's device buffers, full versions, no push
        group (whose members are on other hosts and take host buckets)."""
        return (
            isinstance(self.store, DevicePayloads)
            and self.store.buffers is not None
            and self.encoder.streams
            and self.push is None
        )

    async def publish_packed(
        self,
        pack: Callable[[], Awaitable[tuple[WeightManifest, list[torch.Tensor]]]],
    ) -> tuple[WeightManifest, asyncio.Task[WeightManifest] | None]:
        """``publish`` of a version packed on the trainer's device: ``pack()`` runs
        ``encoder.pack_buckets`` (a trainer gathers into it tensor by tensor:
        ``Learner.pack_weights``), and the buckets become the ``cuda_ipc`` store's device
        buffers. Returns the manifest to announce now, its fallback pending, and the task
        that stores the fallback (one host copy per bucket) and resolves to the completed
        manifest, to announce once done; the fallbacks are stored one version after
        the other. When the device refuses the buckets, the fallback is stored first and
        the manifest returned is complete (no task)."""
        if not self.packs_on_device:
            raise ValueError("publish_packed needs a cuda_ipc store with device buffers")
        assert isinstance(self.store, DevicePayloads)
        store = self.store
        manifest, buckets = await pack()
        held = await store.hold_packed(manifest, buckets)
        if held is None:
            return await self._keep(await store.store_fallback(manifest, buckets)), None
        previous = self._storing

        async def store_fallback() -> WeightManifest:
            if previous is not None:  # in version order: the chains stay in order
                with contextlib.suppress(Exception):  # reported by its own announcer
                    await previous
            return await self._keep(await store.store_fallback(held, buckets))

        self._storing = asyncio.create_task(store_fallback())
        return held, self._storing

    def _push_broken(self, exc: BaseException) -> None:
        log.warning("push group broken (%r); engines pull from the store", exc)
        self.push = None

    async def _keep(self, manifest: WeightManifest) -> WeightManifest:
        """Add a stored version to the kept chains; delete what drops out of them."""
        if manifest.kind == "full" or not self._chains:
            self._chains.append([])
        self._chains[-1].append(manifest)
        while len(self._chains) > self.keep_chains:
            self._expired.extend(self._chains.pop(0))
            # what an earlier trainer process stored goes with this process's first drop
            self._sweep_due = not self._swept
        if self._expired or self._sweep_due:
            await self._delete_expired()
        return manifest

    async def _delete_expired(self) -> None:
        """Delete the payloads of dropped chains and, once, what an earlier trainer
        process stored (older than every chain kept). Housekeeping: a broker that is away
        right now leaves them for the next publish, instead of failing the version just
        stored (and the trainer with it)."""
        try:
            while self._expired:
                await self.store.delete(self._expired[0])
                self._expired.pop(0)
            if self._sweep_due:
                await self.store.delete_before(self._chains[0][0].version)
                self._sweep_due, self._swept = False, True
        except BROKER_ERRORS as exc:
            log.warning(
                "deleting old weight payloads failed (%r); %d left for the next publish",
                exc,
                len(self._expired),
            )

    async def _broadcast(self, group: Collective, encoded: EncodedWeights) -> None:
        try:
            await asyncio.to_thread(collective.send, group, encoded)
        except Exception as exc:  # a member died: the store still has every payload
            self._push_broken(exc)

    async def close(self) -> None:
        """Stop the push group's listeners; delete the payloads of an ephemeral store
        (shared memory is RAM) and free device buffers; payloads in the object store
        stay for engines still catching up."""
        if self._storing is not None:  # a fallback being stored finishes first
            with contextlib.suppress(Exception):
                await self._storing
        if self.push is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(collective.send_stop, self.push)
            with contextlib.suppress(Exception):
                await asyncio.to_thread(collective.close, self.push)
            self.push = None
        if self.store.ephemeral:
            for chain in self._chains:
                for manifest in chain:
                    await self.store.delete(manifest)
            self._chains.clear()
        if isinstance(self.store, DevicePayloads):  # device memory is freed in any case
            await self.store.close()

    def _encode(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> EncodedWeights:
        if self.dtype is not None:
            state_dict = {
                name: t.to(self.dtype) if t.is_floating_point() else t
                for name, t in state_dict.items()
            }
        return self.encoder.encode(version, state_dict)


class _StreamedVersion:
    """The ``BucketSink`` of ``publish_streamed``: called on the encoding thread, it
    stores (and pushes) each bucket on the event loop, one bucket at a time, so the
    encoder fills the next bucket while this one travels."""

    def __init__(
        self, publisher: WeightPublisher, writer: PayloadWriter, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.publisher, self.writer, self.loop = publisher, writer, loop
        self.sending: collective.StreamSend | None = None
        self._pending: concurrent.futures.Future[None] | None = None

    def begin(self, payload_bytes: int, bucket_bytes: int) -> list[torch.Tensor] | None:
        group = self.publisher.push
        if group is None:
            return None
        try:
            self.sending = collective.StreamSend(group, payload_bytes, bucket_bytes, in_flight=1)
            return self.sending.lent_buffers(BUCKET_BUFFERS)
        except Exception as exc:  # a member died: the store still has every payload
            self.sending = None
            self.loop.call_soon_threadsafe(self.publisher._push_broken, exc)
            return None

    def put(self, index: int, bucket: memoryview) -> None:
        self._wait()
        self._pending = asyncio.run_coroutine_threadsafe(self._travel(index, bucket), self.loop)

    def end(self) -> None:
        self._wait()

    async def settle(self) -> None:
        """After a failed encoding: wait for the bucket still travelling, if any, so
        that nothing is written after the partial payload is removed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(Exception):
                await asyncio.wrap_future(pending)

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    async def _travel(self, index: int, bucket: memoryview) -> None:
        if self.sending is None:
            await self.writer.write(index, bucket)
            return
        sending = self.sending
        stored, sent = await asyncio.gather(
            self.writer.write(index, bucket),
            asyncio.to_thread(_broadcast_now, sending, bucket),
            return_exceptions=True,
        )
        if isinstance(sent, BaseException):
            self.sending = None
            self.publisher._push_broken(sent)
        if isinstance(stored, BaseException):
            raise stored


def _broadcast_now(sending: collective.StreamSend, bucket: memoryview) -> None:
    """``bucket`` off the wire before it returns: the encoder reuses its memory."""
    sending.bucket(bucket)
    sending.flush()


class WeightReceiver:
    def __init__(
        self, stores: Mapping[str, PayloadStore], device: torch.device | None = None
    ) -> None:
        self.stores = dict(stores)
        self.mirror = WeightMirror()
        self.device = device
        """Where the engine computes, when that is a device: a version in the trainer's
        device memory (``cuda_ipc``) is copied there, never through host memory."""
        self._on_device: tuple[int, dict[str, torch.Tensor]] | None = None
        """The version copied onto ``device`` last, while newer than the mirror's, until
        the engine has it in its own weights (``release_device_copy``): a whole copy of
        the weights on the card beyond the model's, which a colocated trainer and the
        engine's KV cache need back."""

    @property
    def version(self) -> int:
        """The version held: on the device or in the mirror, whichever is newer."""
        return self._on_device[0] if self._on_device is not None else self.mirror.version

    def tensors(self) -> dict[str, torch.Tensor]:
        """The held version's tensors (views: valid until the next ``follow``)."""
        return self._on_device[1] if self._on_device is not None else self.mirror.tensors()

    def release_device_copy(self) -> int:
        """Drop the version copied onto ``device`` once the engine has loaded it (the
        engine copies into its own weights: hf ``copy_``, vLLM through its staged
        set), and give its memory back to the card. ``version`` is the mirror's again:
        the engine keeps the version it serves, and a later chain that ends at this
        version would be copied again. Returns the bytes of the tensors dropped."""
        if self._on_device is None:
            return 0
        _, tensors = self._on_device
        self._on_device = None
        released = sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if self.device is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator would keep it for this process
        return released

    async def accept(self, pushed: Received) -> int:
        """A pushed payload: apply it if it continues what the mirror holds; returns the
        version held. Raises VersionGap or WeightsCorrupted (nothing applied)."""
        if self.mirror.plan([pushed.manifest]):
            await asyncio.to_thread(
                self.mirror.apply, pushed.manifest, pushed.payload, pushed.bucket_digests
            )
            if self._on_device is not None and self._on_device[0] < self.mirror.version:
                self._on_device = None  # the mirror holds the newer version
        return self.version

    async def follow(self, chain: list[WeightManifest]) -> int:
        """Bring the mirror to the chain's last version (unless it holds it or a newer
        one); returns the version held, whose tensors are ``tensors()``.

        Raises VersionGap (ask for the whole chain), PayloadMissing (pruned or
        unreachable: catch up later) or WeightsCorrupted (refused: nothing applied).
        A full last version in device memory is copied onto ``device`` if there is one
        (``version`` and ``tensors`` then serve it; the mirror keeps what it held)."""
        if chain and chain[-1].version <= self.version:
            return self.version
        if await self._follow_on_device(chain[-1] if chain else None):
            return self.version
        self._on_device = None  # the mirror moves past it, or fails as it would have
        for manifest in self.mirror.plan(chain):
            store = self.stores.get(manifest.transport)
            if store is None:
                raise PayloadMissing(f"no {manifest.transport!r} store on this engine")
            payload = await store.fetch(manifest)
            await asyncio.to_thread(self.mirror.apply, manifest, payload)
        return self.mirror.version

    async def _follow_on_device(self, last: WeightManifest | None) -> bool:
        store = self.stores.get(last.transport) if last is not None else None
        fetch_tensors = getattr(store, "fetch_tensors", None)
        if self.device is None or last is None or last.device is None or fetch_tensors is None:
            return False
        try:
            tensors = await fetch_tensors(last, self.device)
        except (BufferGone, WeightsCorrupted) as exc:
            log.info("version %d: through host memory (%s)", last.version, exc)
            return False
        self._on_device = (last.version, tensors)
        return True
